# Sanitizer and fuzzing builds (scripts/sanitize.sh, scripts/fuzz.sh).
#
# ATTNSERVE_SANITIZE: a -fsanitize= list applied to every C++ object and link
#   of this build: "address,undefined" (ASan + UBSan, any undefined behaviour
#   fails the test that hit it) or "thread" (TSan). Empty: none. Use a build
#   directory of its own: sanitized objects must not mix with plain ones.
# ATTNSERVE_FUZZ: build the libFuzzer targets in tests/fuzz/ (clang only). The
#   project's code gets libFuzzer's coverage hooks (-fsanitize=fuzzer-no-link);
#   each fuzz target links libFuzzer's main (-fsanitize=fuzzer). Combine with
#   ATTNSERVE_SANITIZE=address,undefined so a finding is a report, not luck.
set(ATTNSERVE_SANITIZE "" CACHE STRING
  "Sanitizers for every C++ object: address,undefined or thread (empty: none)")
option(ATTNSERVE_FUZZ "Build the libFuzzer targets in tests/fuzz (needs clang++)" OFF)

if(ATTNSERVE_SANITIZE)
  if(ATTNSERVE_SANITIZE MATCHES "thread" AND ATTNSERVE_SANITIZE MATCHES "address")
    message(FATAL_ERROR "ATTNSERVE_SANITIZE: thread and address cannot be combined")
  endif()
  # Frame pointers make the reports' stacks whole; the optimisation level and
  # line tables come from the build type (scripts/lib-sanitized-build.sh:
  # -O1 -gline-tables-only, file:line in every report).
  set(attnserve_sanitize_flags -fsanitize=${ATTNSERVE_SANITIZE} -fno-omit-frame-pointer)
  if(ATTNSERVE_SANITIZE MATCHES "undefined")
    # UBSan only prints by default; make every report fail the process.
    list(APPEND attnserve_sanitize_flags -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${attnserve_sanitize_flags}>")
  add_link_options(-fsanitize=${ATTNSERVE_SANITIZE})
endif()

if(ATTNSERVE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "ATTNSERVE_FUZZ needs clang++ (-DCMAKE_CXX_COMPILER=clang++): libFuzzer is part of clang")
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>")
endif()
