#include <nanobind/nanobind.h>
NB_MODULE(_C_cuda, m) { m.doc() = "paged CUDA kernels and device block pool"; }
