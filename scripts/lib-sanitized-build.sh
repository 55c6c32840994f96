# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: configures the one
# clang build both use, ASan + UBSan with libFuzzer's coverage hooks, so CI
# compiles the project once for the sanitized tests and the fuzzers.
# Sets nothing but the build directory's CMake cache.
# -O1 -gline-tables-only: what the sanitizers' documentation suggests (fast
# enough code, reports with file:line) and smaller objects than -O2 -g. It
# does not make the build much faster: the instrumentation dominates.
sanitized_build_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG")
configure_sanitized_build() {
  local build_dir=$1
  cmake -S . -B "$build_dir" -G Ninja "${sanitized_build_flags[@]}" \
    -DCMAKE_CXX_COMPILER=clang++ -DATTNSERVE_CUDA=OFF -DATTNSERVE_BUILD_BENCH=OFF \
    -DATTNSERVE_FUZZ=ON -DATTNSERVE_SANITIZE=address,undefined \
    ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER}
}
