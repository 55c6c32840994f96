# Looks for CUDA when ATTNSERVE_CUDA is AUTO; sets ATTNSERVE_HAVE_CUDA.
include(CheckLanguage)
set(ATTNSERVE_HAVE_CUDA OFF)
if(ATTNSERVE_CUDA STREQUAL "ON" OR ATTNSERVE_CUDA STREQUAL "AUTO")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm80 portable path plus the Hopper sm_90a path (docs/design.md §3).
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # SASS for sm80 (A100; sm86/89 run it too) and sm90 (H100), plus sm90 PTX
      # so newer GPUs JIT it; "80 90" also embedded sm80 PTX nobody uses and
      # cost CI an extra compile of every kernel.
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(ATTNSERVE_HAVE_CUDA ON)
    message(STATUS "attnserve: CUDA backend ON (${CMAKE_CUDA_COMPILER}, archs ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(ATTNSERVE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ATTNSERVE_CUDA=ON but no CUDA compiler was found")
  else()
    message(STATUS "attnserve: no CUDA compiler found; CPU backend only")
  endif()
endif()
