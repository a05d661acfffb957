// The one message shape for argument errors in every C++ module:
//   "<name>: expected <X>, got <Y>"
// the same as the Python backends' (backends/arg_checks.py), so a user reads
// one format whichever device rejected a call. The exception type carries the
// kind, which nanobind maps: std::invalid_argument -> ValueError (bad shape,
// dtype, device or value), std::out_of_range -> IndexError (an id outside its
// range). Header-only: csrc_cpu and csrc_cuda include it through paged_shared.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

namespace paged::args {

inline std::string str(const std::string& s) { return s; }
inline std::string str(const char* s) { return s; }
template <class T, class = std::enable_if_t<std::is_arithmetic_v<T>>>
std::string str(T v) { return std::to_string(v); }

// "<name>: expected <want>, got <got>".
template <class W, class G>
std::string expected(const std::string& name, const W& want, const G& got) {
  return name + ": expected " + str(want) + ", got " + str(got);
}

// ValueError with the message above.
template <class W, class G>
[[noreturn]] void fail(const std::string& name, const W& want, const G& got) {
  throw std::invalid_argument(expected(name, want, got));
}

// IndexError with the message above.
template <class W, class G>
[[noreturn]] void fail_index(const std::string& name, const W& want, const G& got) {
  throw std::out_of_range(expected(name, want, got));
}

}  // namespace paged::args
