// The Python module ddpkit._C. Importing it loads the library, which runs the static op
// registrations (register.cpp: torch.ops.ddpkit.*), and binds the one class that has to cross
// pybind11: the "ddpkit" torch.distributed backend, which torch.distributed wants as a Python
// object derived from its own Backend class. The only file that includes pybind11 or Python
// headers; compiled against torch's bundled pybind11 so the types cross between the two modules.

#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/backend.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddpkit native ops (torch.ops.ddpkit) and the ddpkit torch.distributed backend";
  // Needs torch.distributed's classes (import torch.distributed first): c10d::Backend is the base.
  py::class_<ddpkit::backend::Backend, c10d::Backend, c10::intrusive_ptr<ddpkit::backend::Backend>>(m, "Backend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const c10::intrusive_ptr<c10d::Backend>& gloo,
                       const c10::intrusive_ptr<c10d::Backend>& gloo_p2p) {
             return c10::make_intrusive<ddpkit::backend::Backend>(store, rank, size, timeout, gloo, gloo_p2p);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("gloo"), py::arg("gloo_p2p"),
           "See Note [The ddpkit backend] in csrc/backend/backend.h; made by ddpkit.backend's creator.");
}
