#pragma once
// Collectives built only from the point-to-point messages of comm::Communicator.
//
// Contract shared by every function here:
//  - `tensor` is contiguous and dense, on the device of the communicator's backend, with the same
//    numel and dtype on every rank (checked when Note [Collective checks] is on);
//  - dtypes float32 and float64 are reduced as they are; float16 and bfloat16 are reduced in a
//    float32 copy and written back once; int32 and int64 are reduced exactly (not with kMean);
//  - the call is synchronous: it returns when this rank's part is done and its buffers are free;
//  - `comm` comes from the group's Engine, which numbered the collective (Note [Collective engine]).

#include "comm/core/algorithm.h"
#include "comm/core/communicator.h"
#include "comm/reduction/reduce_op.h"

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddpkit::comm {

// All-reduce `tensor` in place: on return every rank holds op(tensor of rank 0, ..., rank n-1),
// bitwise identical on all ranks.
void all_reduce_(at::Tensor& tensor, ReduceOp op, Algorithm algorithm, Communicator& comm);

// Copies `tensor` of rank `src` into `tensor` of every rank: across hosts hierarchically, else a
// binomial tree (ceil(log2 n) rounds).
void broadcast_(at::Tensor& tensor, int src, Communicator& comm);

// Leaves op(tensor of all ranks) in `tensor` of rank `dst`: across hosts hierarchically, else a
// binomial tree. Like torch.distributed.reduce, the tensors of the other ranks hold unspecified
// partial results afterwards (across hosts, small ones the whole result).
void reduce_(at::Tensor& tensor, int dst, ReduceOp op, Communicator& comm);

// Returns, on rank `dst`, a new tensor of shape [n, *tensor.shape] whose row i is rank i's tensor;
// an empty tensor on the other ranks.
at::Tensor gather(const at::Tensor& tensor, int dst, Communicator& comm);

// On rank `dst`, writes rank i's `tensor` into outputs[i]: n tensors of tensor's numel, dtype and
// device, any shape (a bad list on dst is rejected in the collective check, so every rank raises).
// `outputs` is ignored on the other ranks.
void gather_into(std::vector<at::Tensor>& outputs, const at::Tensor& tensor, int dst, Communicator& comm);

// Writes row i of `chunks` (rank `src`'s, shape [n, *output.shape]) into `output` of rank i.
// `chunks` is ignored on the other ranks.
void scatter_(at::Tensor& output, const at::Tensor& chunks, int src, Communicator& comm);

// Writes inputs[i] (rank `src`'s: n tensors of output's numel, dtype and device) into `output` of
// rank i; `inputs` is ignored on the other ranks. A non-empty `error` rejects this rank's arguments
// in the collective check (every rank raises).
void scatter_from(at::Tensor& output, const std::vector<at::Tensor>& inputs, int src, Communicator& comm,
                  std::string error = {});

// all_gather_into_tensor_ and reduce_scatter_tensor_ run `algorithm` (Note [All-gather and
// reduce-scatter] in core/algorithm.h); one a rank cannot run rejects its arguments, so every rank raises.
// In place as torch's backends allow (FSDP2 all-gathers this way): the all-gather's input may be
// exactly this rank's block of its output, the reduce-scatter's output exactly this rank's block of
// its input; no other overlap.

// Writes rank i's `input` into block i of `output` (contiguous, n·input.numel() elements, the same
// dtype) on every rank. Any dtype.
void all_gather_into_tensor_(at::Tensor& output, const at::Tensor& input, Algorithm algorithm, Communicator& comm);

// Writes op over the ranks' block `rank` of `input` (contiguous, n·output.numel() elements, the
// same dtype as `output`) into `output`; `input` is left unchanged.
void reduce_scatter_tensor_(at::Tensor& output, const at::Tensor& input, ReduceOp op, Algorithm algorithm,
                            Communicator& comm);

// Sends inputs[j] to rank j and receives outputs[j] from rank j (this rank's own pair is a copy):
// n contiguous tensors each, one dtype; rank i's inputs[j] and rank j's outputs[i] have the same
// numel (torch's all_to_all). One round of n-1 concurrent messages each way. A pair whose sizes
// disagree across two ranks fails on its receiver, naming both sizes; sizes a rank disagrees with
// itself about are rejected in the collective check.
void all_to_all_(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, Communicator& comm);

// Returns when every rank of the group has called it.
void barrier(Communicator& comm);

// Takes part in the group's next collective, a `kind`, as a rank that rejected its own arguments for
// the reason `error` (a bad op, algorithm or transport name, a tensor a collective cannot take):
// every rank of the group raises, its peers naming this rank, and the group stays usable (Note
// [Collective checks]). Always throws `error` here.
[[noreturn]] void reject(CollectiveKind kind, const std::string& error, Communicator& comm);

// Takes part in the group's next collective with meta tensors: the collective check alone, with a
// header marked "meta" and the fields the real collective would have, and no data. When every rank
// passes meta tensors they agree and nothing moves; when some rank passes real ones, every rank
// raises, naming the difference (a meta tensor on one rank would otherwise skip the collective
// there, pairing that rank's next collective with its peers' current one). A non-empty `error`
// rejects this rank's arguments, as in reject().
void meta_collective(CollectiveKind kind, const at::Tensor& tensor, std::optional<ReduceOp> op,
                     std::optional<Algorithm> algorithm, int root, Communicator& comm, std::string error = {});

}  // namespace ddpkit::comm
