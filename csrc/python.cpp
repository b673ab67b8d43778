// The Python module ddpkit._C. Importing it loads the library, which runs the static op
// registrations (register.cpp: torch.ops.ddpkit.*), and binds what has to cross pybind11: the
// "ddpkit" torch.distributed backend, which torch.distributed wants as a Python object derived from
// its own Backend class, the eager all-reduce (Note [Eager calls past the dispatcher]),
// SyncBatchNorm's eager call (Note [SyncBatchNorm's eager call]) and the DDP reducer's Python
// communication hook (Note [Communication hooks]). The only file that includes
// pybind11 or Python headers; compiled against torch's bundled pybind11 so the types cross between
// the two modules.

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/chrono.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/utils/pybind.h>

#include "comm/core/wire_format.h"
#include "backend/backend.h"
#include "comm/engine/completion_pool.h"
#include "comm/engine/engine.h"
#include "comm/engine/ops.h"
#include "ddp/reducer.h"
#include "syncbn/syncbn.h"

#include <array>
#include <optional>

namespace py = pybind11;

namespace {

// Note [Eager calls past the dispatcher]
// A Python call of torch.ops.ddpkit.all_reduce_ spends as long in argument parsing and the
// dispatcher as the whole all-reduce of 1k floats between two ranks takes (bench_latency.py's
// layers, Note [Where a small all-reduce's time goes]). ddpkit.all_reduce therefore calls the kernel
// directly when nothing the dispatcher would do applies: a plain CPU torch.Tensor (not a subclass,
// no Python or functionalization key, no conjugate or negative bit, not an inference tensor) that
// does not require grad, with no torch function mode, no dispatch mode and no thread-local dispatch
// key beyond the default ones (functorch transforms, meta tracing) in effect. It then does what the
// op's ADInplaceOrView kernel would: bump the tensor's version counter, so autograd still sees the
// in-place write. Anything else takes the op, which stays the one definition: the same kernel,
// checks and errors; torch.compile never sees this function (ddpkit.comm registers a substitute
// for it, Note [Collectives under torch.compile]). The binding itself is a plain CPython
// function reading its strings in place, which cost less per call than pybind11's overload
// dispatch and string casters did for the same function (bench_latency.py's Python layers show
// what the binding costs now).
bool eager_all_reduce_applies(PyObject* object) {
  if (!THPVariable_CheckExact(object)) return false;
  const at::Tensor& tensor = THPVariable_Unpack(object);
  constexpr c10::DispatchKeySet kUnhandled =
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                           c10::DispatchKey::Functionalize, c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return tensor.defined() && tensor.device().is_cpu() && tensor.layout() == c10::kStrided && !tensor.requires_grad() &&
         !tensor.is_inference() && !tensor.key_set().has_any(kUnhandled) && !at::impl::torch_function_mode_enabled() &&
         !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
         c10::impl::tls_local_dispatch_key_set().included_ == c10::default_included_set;
}

// The UTF-8 bytes of the str `object`, which stays alive (and immutable) for the call.
std::string_view utf8_of(PyObject* object, const char* what) {
  TORCH_CHECK_TYPE(PyUnicode_Check(object), "ddpkit: ", what, " must be a str, got ", Py_TYPE(object)->tp_name);
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(object, &size);
  if (data == nullptr) throw python_error();
  return std::string_view(data, static_cast<size_t>(size));
}

// all_reduce_eager(tensor, op, algorithm, group_name, transport, wire) -> bool: the kernel of
// ddpkit::all_reduce_ on `tensor` where eager_all_reduce_applies, else False with nothing done.
PyObject* all_reduce_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 6, "ddpkit: all_reduce_eager takes 6 arguments, got ", nargs);
  if (!eager_all_reduce_applies(args[0])) Py_RETURN_FALSE;
  const std::string_view op = utf8_of(args[1], "op");
  const std::string_view algorithm = utf8_of(args[2], "algorithm");
  const std::string group_name(utf8_of(args[3], "group_name"));
  const std::string_view transport = utf8_of(args[4], "transport");
  const std::string_view wire = utf8_of(args[5], "wire");
  at::Tensor target = THPVariable_Unpack(args[0]);
  {
    py::gil_scoped_release no_gil;
    ddpkit::comm::all_reduce_op(target, op, algorithm, group_name, transport, wire);
  }
  target.unsafeGetTensorImpl()->bump_version();
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// Note [SyncBatchNorm's eager call]
// SyncBatchNorm's forward calls ddpkit::sync_batch_norm through the dispatcher's typed handle from
// this binding rather than through torch.ops: the dispatcher still runs every key (autograd,
// autocast, dispatch modes, functorch, the profiler's record), only torch.ops' boxing of the ten
// Python arguments into IValues and of the four outputs back is skipped, which brought a small
// layer's forward+backward below torch's BatchNorm1d (bench_syncbn.py's ddpkit_local against
// torch_bn_local at world size 1). Tensor
// subclasses and torch function modes, which torch.ops hands to __torch_function__, and arguments of
// other types than the module passes take the op (the binding returns None).
PyObject* sync_batch_norm_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 10, "ddpkit: sync_batch_norm_eager takes 10 arguments, got ", nargs);
  if (!THPVariable_CheckExact(args[0]) || at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;
  std::array<std::optional<at::Tensor>, 4> per_channel;  // weight, bias, running_mean, running_var
  for (size_t i = 0; i < per_channel.size(); ++i) {
    PyObject* object = args[i + 1];
    if (object == Py_None) continue;
    if (!THPVariable_CheckExact(object)) Py_RETURN_NONE;
    per_channel[i] = THPVariable_Unpack(object);
  }
  // Arguments of any other type take the op too, which then says what it expects.
  auto is_number = [](PyObject* object) { return PyFloat_CheckExact(object) || PyLong_CheckExact(object); };
  if (!PyBool_Check(args[5]) || !is_number(args[6]) || !is_number(args[7]) || !PyUnicode_Check(args[8]) ||
      !(args[9] == Py_None || PyUnicode_Check(args[9]))) {
    Py_RETURN_NONE;
  }
  const bool training = args[5] == Py_True;
  const double momentum = PyFloat_AsDouble(args[6]);
  if (momentum == -1.0 && PyErr_Occurred()) throw python_error();
  const double eps = PyFloat_AsDouble(args[7]);
  if (eps == -1.0 && PyErr_Occurred()) throw python_error();
  const std::string_view algorithm = utf8_of(args[8], "algorithm");
  std::optional<std::string_view> group_name;
  if (args[9] != Py_None) group_name = utf8_of(args[9], "group_name");
  const at::Tensor& input = THPVariable_Unpack(args[0]);
  at::Tensor output;
  {
    py::gil_scoped_release no_gil;  // the forward's all-reduce may wait for the other ranks
    output = std::get<0>(ddpkit::syncbn::sync_batch_norm_op().call(input, per_channel[0], per_channel[1],
                                                                   per_channel[2], per_channel[3], training, momentum,
                                                                   eps, algorithm, group_name));
  }
  return THPVariable_Wrap(std::move(output));
  END_HANDLE_TH_ERRORS
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddpkit native ops (torch.ops.ddpkit) and the ddpkit torch.distributed backend";
  // Needs torch.distributed's classes (import torch.distributed first): c10d::Backend is the base.
  py::class_<ddpkit::backend::Backend, c10d::Backend, c10::intrusive_ptr<ddpkit::backend::Backend>>(m, "Backend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const c10::intrusive_ptr<c10d::Backend>& gloo,
                       const c10::intrusive_ptr<c10d::Backend>& gloo_p2p, const std::string& cross_host_wire) {
             return c10::make_intrusive<ddpkit::backend::Backend>(store, rank, size, timeout, gloo, gloo_p2p,
                                                                  ddpkit::comm::parse_wire_format(cross_host_wire));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("gloo"), py::arg("gloo_p2p"),
           py::arg("cross_host_wire") = "exact",
           "See Note [The ddpkit backend] in csrc/backend/backend.h; made by ddpkit.backend's creator.")
      .def_property_readonly(
          "cross_host_wire",
          [](const ddpkit::backend::Backend& backend) {
            return std::string(ddpkit::comm::wire_format_name(backend.cross_host_wire()));
          },
          "The wire format of the group's sums and means across hosts (Note [Compressed crossing]).");
  // A plain CPython function (METH_FASTCALL), not pybind11's (Note [Eager calls past the dispatcher]).
  static PyMethodDef all_reduce_eager_def = {
      "all_reduce_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(all_reduce_eager)), METH_FASTCALL,
      "all_reduce_eager(tensor, op, algorithm, group_name, transport, wire) -> bool: ddpkit::all_reduce_'s kernel "
      "called "
      "directly, or False (nothing done) where the op must run: Note [Eager calls past the dispatcher] in "
      "csrc/python.cpp."};
  m.add_object("all_reduce_eager", py::reinterpret_steal<py::object>(PyCFunction_New(&all_reduce_eager_def, nullptr)));
  static PyMethodDef sync_batch_norm_eager_def = {
      "sync_batch_norm_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sync_batch_norm_eager)),
      METH_FASTCALL,
      "sync_batch_norm_eager(input, weight, bias, running_mean, running_var, training, momentum, eps, algorithm, "
      "group_name) -> Tensor | None: ddpkit::sync_batch_norm's output through the dispatcher, or None where the "
      "op must be called from Python: Note [SyncBatchNorm's eager call] in csrc/python.cpp."};
  m.add_object("sync_batch_norm_eager",
               py::reinterpret_steal<py::object>(PyCFunction_New(&sync_batch_norm_eager_def, nullptr)));
  // The reducer is a TorchScript class (register.cpp); a Python hook has to cross pybind11, and torch's
  // PythonCommHook is what torch's own reducer keeps for one (Note [Communication hooks]).
  m.def(
      "register_comm_hook",
      [](const torch::jit::Object& reducer, py::object state, py::object hook) {
        auto native = c10::IValue(reducer._ivalue()).toCustomClass<ddpkit::ddp::Reducer>();
        auto python_hook = std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook));
        // The reducer's lock: a backward on another thread holds it while its hook waits for the GIL.
        py::gil_scoped_release release;
        native->register_comm_hook(std::move(python_hook));
      },
      py::arg("reducer"), py::arg("state"), py::arg("hook"),
      "register_comm_hook(reducer, state, hook): hook(state, bucket: torch.distributed.GradBucket) -> "
      "torch.futures.Future[Tensor] replaces the all-reduce of each bucket of `reducer` (a "
      "torch.classes.ddpkit.Reducer): Note [Communication hooks] in csrc/ddp/reducer.h.");
  m.def(
      "prepare_for_exit",
      [] {
        py::gil_scoped_release release;  // the completions it waits for run Python callbacks
        ddpkit::comm::CompletionPool::instance().prepare_for_exit();
        ddpkit::comm::Engine::release_destroyed();  // their gloo backends' threads too
      },
      "Called by atexit (ddpkit/__init__.py): Note [Exit paths] in csrc/comm/engine/completion_pool.h.");
}
