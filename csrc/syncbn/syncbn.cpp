#include "syncbn/syncbn.h"

#include "comm/collectives/collectives.h"
#include "comm/engine/engine.h"
#include "syncbn/kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace ddpkit::syncbn {
namespace {

constexpr const char* kName = "ddpkit.sync_batch_norm";

bool supported_input_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

bool reduced_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Weight, bias and running statistics have the input's dtype, or float32 beside a float16/bfloat16
// input (and one dtype among them, checked in check_per_channel).
void check_parameter_dtype(at::ScalarType input_dtype, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(dtype == input_dtype || (reduced_precision(input_dtype) && dtype == at::kFloat), kName, ": ", name,
              " has dtype ", dtype, " but the input has dtype ", input_dtype,
              "; parameters and running statistics must have the input's dtype (or float32 for a float16/bfloat16 "
              "input)");
}

void check_per_channel(const std::optional<at::Tensor>& t, const char* name, const at::Tensor& input,
                       std::optional<at::ScalarType>& parameter_dtype) {
  if (!t || !t->defined()) return;
  const int64_t channels = input.size(1);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == channels, kName, ": ", name, " should have shape [", channels,
              "] (the input's channels, dim 1 of ", input.sizes(), "), got ", t->sizes());
  TORCH_CHECK(t->device() == input.device(), kName, ": ", name, " is on ", t->device(), " but the input is on ",
              input.device());
  check_parameter_dtype(input.scalar_type(), t->scalar_type(), name);
  if (!parameter_dtype) parameter_dtype = t->scalar_type();
  TORCH_CHECK(*parameter_dtype == t->scalar_type(), kName,
              ": weight, bias and running statistics must share one dtype; ", name, " has ", t->scalar_type(),
              ", another has ", *parameter_dtype);
}

void check_input(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2, kName, ": expected an input of shape (N, C, *) with at least 2 dimensions, got shape ",
              input.sizes());
  TORCH_CHECK(input.size(1) > 0, kName, ": the input has no channels (shape ", input.sizes(), ")");
  TORCH_CHECK(input.layout() == at::kStrided, kName, ": expected a dense input, got layout ", input.layout());
  TORCH_CHECK(supported_input_dtype(input.scalar_type()), kName, ": unsupported input dtype ", input.scalar_type(),
              "; supported: float32, float64, float16, bfloat16");
}

// A statistic the forward saved (Note [Saved statistics] in syncbn/kernels.h): [C] in the input's
// arithmetic dtype, float64 for a float64 input and float32 otherwise.
void check_statistic(const at::Tensor& t, const char* name, const at::Tensor& input) {
  const at::ScalarType arithmetic = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(t.scalar_type() == arithmetic && t.dim() == 1 && t.size(0) == input.size(1) && t.is_contiguous() &&
                  t.device() == input.device(),
              kName, "_backward: ", name, " must be the forward's ", arithmetic,
              " [C] statistic on the input's device, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// Runs the pass's one all-reduce (Note [One all-reduce per pass]); returns the group's size.
int all_reduce(at::Tensor& buffer, comm::Algorithm algorithm, std::string_view group_name) {
  auto engine = comm::Engine::of(std::string(group_name));
  engine->run(buffer.device().type(), comm::TransportKind::kAuto, "all_reduce",
              [&](comm::Communicator& comm) { comm::all_reduce_(buffer, comm::ReduceOp::kSum, algorithm, comm); });
  return engine->size();
}

// Runs `checks` of this rank's arguments. When they fail and the pass would all-reduce over
// `group_name`, this rank first takes part in that all-reduce as a rank that rejects its arguments,
// so that every rank of the group raises instead of waiting for it and the next passes pair (Note
// [Collective checks]); then it raises its own error.
template <class Checks>
void check_or_reject(Checks&& checks, const at::Tensor& input, bool communicates,
                     std::optional<std::string_view> group_name) {
  try {
    checks();
  } catch (const c10::Error& e) {
    if (communicates && group_name) {
      const std::string error = e.what_without_backtrace();
      const c10::DeviceType device = input.defined() ? input.device().type() : c10::kCPU;
      try {
        comm::Engine::of(std::string(*group_name))
            ->run(device, comm::TransportKind::kAuto, "all_reduce",
                  [&](comm::Communicator& comm) { comm::reject(comm::CollectiveKind::kAllReduce, error, comm); });
      } catch (const std::exception&) {
        // reject always raises; this rank's own error (below) is the one to report
      }
    }
    throw;
  }
}

// torch's autograd graph holds its nodes by c10::intrusive_ptr from torch 2.13 on and by
// std::shared_ptr before (the lent GPU machines' CUDA torch is 2.11): make_node builds a node the
// way the torch it is compiled against holds them, read off Tensor::grad_fn's type.
using NodePtr = std::remove_cvref_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

using BackwardFn = decltype(sync_batch_norm_backward);

const c10::TypedOperatorHandle<BackwardFn>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("ddpkit::sync_batch_norm_backward", "").typed<BackwardFn>();
  return op;
}

// Note [SyncBatchNorm's autograd node]
// The Autograd kernel records one node of its own, as torch's generated code does for its ops
// (NativeBatchNormBackward0), rather than a torch::autograd::Function: a CppNode checks and wraps
// every one of the op's 11 arguments and 3 outputs and keeps its state in a map keyed by strings.
// The node is what let a small layer's forward+backward match torch's F.batch_norm (bench_syncbn.py,
// ddpkit_local against torch_bn_local at world size 1); the Function's wrapping cost more than the
// pass itself on such a layer.
// Edges 0, 1 and 2 are input, weight and bias (an empty edge for an absent or frozen one). Only
// `output` has this node as its grad_fn; mean and invstd are computed below autograd and carry no
// gradient, so the node's one input is output's gradient, which an undefined tensor may stand for:
// the backward then runs on zeros, so that a group's backward all-reduce is never skipped.
// A backward run under compiled autograd (torch._dynamo.compiled_autograd's enable) raises
// "compiled_args not implemented: SyncBatchNormBackward"; the Function failed there too, on an
// internal assert of torch's.
// The backward is differentiable once, as torch.nn.SyncBatchNorm's: under create_graph=True its
// gradients get an Error node as grad_fn (what torch's @once_differentiable does), so that a second
// backward through them raises rather than silently leaving out their second-order terms.
struct SyncBatchNormBackward final : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor input = input_.unpack();
    const at::Tensor weight = weight_.unpack();
    const at::Tensor grad_output = grads[0].defined() ? grads[0] : at::zeros_like(input);
    const std::array<bool, 3> mask{task_should_compute_output(0), task_should_compute_output(1),
                                   task_should_compute_output(2)};
    std::optional<std::string_view> group;
    if (group_name) group = *group_name;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [grad_input, grad_weight, grad_bias] =
        backward_op().call(grad_output, input, weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt,
                           mean_.unpack(), invstd_.unpack(), training, count, algorithm, group, mask);
    torch::autograd::variable_list grads_in{grad_input, grad_weight, grad_bias};
    if (torch::autograd::compute_requires_grad(grad_output, input, weight)) {
      auto error = make_node<torch::autograd::Error>(
          "ddpkit.SyncBatchNorm's backward is not differentiable: a second backward through it (double "
          "backward, e.g. a gradient penalty) is not supported, as with torch.nn.SyncBatchNorm",
          torch::autograd::collect_next_edges(grad_output, input, weight));
      torch::autograd::set_history(grads_in, error);
    }
    return grads_in;
  }
  std::string name() const override { return "SyncBatchNormBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input_.reset_data();
    weight_.reset_data();
    mean_.reset_data();
    invstd_.reset_data();
  }

  torch::autograd::SavedVariable input_, weight_, mean_, invstd_;
  bool training = true;
  int64_t count = 0;
  std::string algorithm;
  std::optional<std::string> group_name;
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> sync_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, std::string_view algorithm, std::optional<std::string_view> group_name) {
  std::optional<at::ScalarType> parameter_dtype;
  const bool has_running = running_mean && running_mean->defined();
  comm::Algorithm parsed = comm::Algorithm::kAuto;
  check_or_reject(
      [&] {
        check_input(input);
        check_per_channel(weight, "weight", input, parameter_dtype);
        check_per_channel(bias, "bias", input, parameter_dtype);
        check_per_channel(running_mean, "running_mean", input, parameter_dtype);
        check_per_channel(running_var, "running_var", input, parameter_dtype);
        TORCH_CHECK(has_running == (running_var && running_var->defined()), kName,
                    ": running_mean and running_var must be given together");
        TORCH_CHECK(training || has_running, kName, ": running_mean and running_var are required when training=False");
        parsed = comm::parse_algorithm(algorithm);
      },
      input, training, group_name);

  const LocalInput in = prepare_input(input);
  const at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
  if (!training) {
    const BatchStats stats = stats_from_running(in, *running_mean, *running_var, eps);
    return {normalize(in, stats.mean, stats.invstd, w, b), stats.mean, stats.invstd, in.count()};
  }

  const RunningStats running = has_running ? RunningStats{*running_mean, *running_var, momentum} : RunningStats{};
  // The running estimates were left alone for a single value per channel (RunningStats).
  auto check_count = [&](double count, int ranks) {
    TORCH_CHECK_VALUE(
        count != 1, "Expected more than 1 value per channel when training, got input size ", input.sizes(),
        group_name ? c10::str(" on this rank; the batch of all ", ranks, " ranks of the group has 1") : std::string());
  };
  if (!group_name) {
    // A single value per channel is known before the pass; the fused pass must not write its output.
    check_count(static_cast<double>(in.count()), 1);
    auto [output, stats] = normalize_local(in, eps, running, w, b);
    return {output, stats.mean, stats.invstd, static_cast<int64_t>(stats.count)};
  }
  at::Tensor packed = packed_moments(in);
  const int ranks = all_reduce(packed, parsed, *group_name);
  const BatchStats stats = stats_from_packed(in, packed, eps, running);
  check_count(stats.count, ranks);
  return {normalize(in, stats.mean, stats.invstd, w, b), stats.mean, stats.invstd, static_cast<int64_t>(stats.count)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, bool training, int64_t count, std::string_view algorithm,
    std::optional<std::string_view> group_name, std::array<bool, 3> output_mask) {
  std::optional<at::ScalarType> parameter_dtype;
  comm::Algorithm parsed = comm::Algorithm::kAuto;
  const auto [want_input, want_weight, want_bias] = output_mask;
  check_or_reject(
      [&] {
        check_input(input);
        TORCH_CHECK(grad_output.sizes() == input.sizes() && grad_output.scalar_type() == input.scalar_type() &&
                        grad_output.device() == input.device(),
                    kName, "_backward: grad_output must match the input's shape, dtype and device; got ",
                    grad_output.sizes(), " ", grad_output.scalar_type(), " on ", grad_output.device(), " for an input ",
                    input.sizes(), " ", input.scalar_type(), " on ", input.device());
        check_per_channel(weight, "weight", input, parameter_dtype);
        check_statistic(mean, "mean", input);
        check_statistic(invstd, "invstd", input);
        parsed = comm::parse_algorithm(algorithm);
      },
      input, want_input && training, group_name);

  const LocalInput in = prepare_input(input);
  const at::Tensor dy = match_layout(in, grad_output);
  const at::Tensor w = weight.value_or(at::Tensor());
  const at::ScalarType grad_dtype =
      parameter_dtype.value_or(reduced_precision(input.scalar_type()) ? at::kFloat : input.scalar_type());
  if (training && !group_name) {
    if (!want_input && !want_weight && !want_bias) return {};
    auto [grad_input, grad_weight, grad_bias] = backward_local(in, dy, mean, invstd, w, grad_dtype, output_mask);
    return {grad_input, grad_weight, grad_bias};
  }
  at::Tensor grad_input;
  LocalGradSums local;
  if (want_weight || want_bias || (want_input && training)) {
    local = local_grad_sums(in, dy, mean, invstd, grad_dtype, want_weight, want_bias);
  }
  if (want_input) {
    if (training) {
      if (group_name) all_reduce(local.sums, parsed, *group_name);
      grad_input = grad_input_training(in, dy, mean, invstd, w, local.sums, static_cast<double>(count));
    } else {
      grad_input = grad_input_eval(in, dy, invstd, w);
    }
  }
  return {grad_input, local.grad_weight, local.grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> sync_batch_norm_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, std::string_view algorithm, std::optional<std::string_view> group_name) {
  // Note [SyncBatchNorm's autograd node]
  auto requires_grad = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
  decltype(make_node<SyncBatchNormBackward>()) node;
  if (at::GradMode::is_enabled() && (input.requires_grad() || requires_grad(weight) || requires_grad(bias))) {
    node = make_node<SyncBatchNormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  }
  at::Tensor output, mean, invstd;
  int64_t count = 0;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(output, mean, invstd, count) = sync_batch_norm_op().call(input, weight, bias, running_mean, running_var,
                                                                      training, momentum, eps, algorithm, group_name);
  }
  if (node) {
    node->input_ = torch::autograd::SavedVariable(input, /*is_output=*/false);
    node->weight_ = torch::autograd::SavedVariable(weight.value_or(at::Tensor()), /*is_output=*/false);
    node->mean_ = torch::autograd::SavedVariable(mean, /*is_output=*/false);
    node->invstd_ = torch::autograd::SavedVariable(invstd, /*is_output=*/false);
    node->training = training;
    node->count = count;
    node->algorithm = std::string(algorithm);
    if (group_name) node->group_name = std::string(*group_name);
    torch::autograd::set_history(output, node);
  }
  return {output, mean, invstd, count};
}

const c10::TypedOperatorHandle<decltype(sync_batch_norm)>& sync_batch_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("ddpkit::sync_batch_norm", "").typed<decltype(sync_batch_norm)>();
  return op;
}

void set_syncbn_native_cpu_kernels_op(bool enabled) { set_native_cpu_kernels(enabled); }

std::string syncbn_cpu_kernels_op() { return cpu_kernels_name(); }

}  // namespace ddpkit::syncbn
