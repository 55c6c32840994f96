// What every fuzz target does when a property it checks fails: print why and
// abort, which libFuzzer reports as a crash and saves the input for.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace attnserve {

[[noreturn]] inline void FuzzFail(const char* target, const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", target, what.c_str());
  std::abort();
}

}  // namespace attnserve
