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

# TSan and Debian's Abseil: libabsl_synchronization is not instrumented, so
# TSan cannot see absl::Mutex, CondVar or Notification synchronise and reports
# every access they guard. tests/tsan/absl_sync_annotations.cc wraps the
# library's entry points that our code calls (-Wl,--wrap=SYMBOL, the symbols
# below) and tells TSan what each did, as an Abseil built with TSan would.
# attnserve_tsan_annotate_all_targets() (called at the end of the top-level
# CMakeLists.txt, once every target exists) links that object into every
# executable and shared library. Symbols are of Debian 12's Abseil (inline
# namespace debian3); another Abseil fails at link time, loudly.
if(ATTNSERVE_SANITIZE STREQUAL "thread")
  set(attnserve_tsan_wrapped_absl
    _ZN4absl7debian35Mutex4LockEv
    _ZN4absl7debian35Mutex6UnlockEv
    _ZN4absl7debian35Mutex10ReaderLockEv
    _ZN4absl7debian35Mutex12ReaderUnlockEv
    _ZN4absl7debian35Mutex7TryLockEv
    _ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE
    _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE
    _ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE
    _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE
    _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE
    _ZN4absl7debian37CondVar4WaitEPNS0_5MutexE
    _ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE
    _ZN4absl7debian35MutexD1Ev
    _ZN4absl7debian312Notification6NotifyEv
    _ZNK4absl7debian312Notification19WaitForNotificationEv
    _ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE)
  foreach(symbol IN LISTS attnserve_tsan_wrapped_absl)
    add_link_options("LINKER:--wrap=${symbol}")
  endforeach()
  add_library(attn_tsan_absl OBJECT ${CMAKE_SOURCE_DIR}/tests/tsan/absl_sync_annotations.cc)
  target_link_libraries(attn_tsan_absl PUBLIC absl::synchronization absl::time)
endif()

# Links attn_tsan_absl into every executable, shared library and module in
# `dir` and below (no-op unless ATTNSERVE_SANITIZE is thread).
function(attnserve_tsan_annotate_all_targets dir)
  if(NOT TARGET attn_tsan_absl)
    return()
  endif()
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(type MATCHES "^(EXECUTABLE|SHARED_LIBRARY|MODULE_LIBRARY)$")
      target_link_libraries(${target} PRIVATE attn_tsan_absl)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(subdir IN LISTS subdirs)
    attnserve_tsan_annotate_all_targets(${subdir})
  endforeach()
endfunction()

if(ATTNSERVE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "ATTNSERVE_FUZZ needs clang++ (-DCMAKE_CXX_COMPILER=clang++): libFuzzer is part of clang")
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>")
endif()
