# Chooses SPRNN_CUDA_ARCHITECTURES from the toolkit version unless SPRNN_CUDA_ARCHS or
# CMAKE_CUDA_ARCHITECTURES is given. CUDA 13 dropped sm_70 (V100); CUDA 12 still targets it.
# The last architecture also embeds PTX so newer GPUs JIT-compile it. No 86-real or 89-real:
# sm_80 machine code runs on every 8.x GPU (XLA's default list stops at sm_80 too), no kernel
# has an 8.6/8.9-specific path, and each architecture costs a fifth of the CUDA build, which
# took 37 of CI's 90 minutes on a slow 2-core machine (BUILD_NOTES.md).
if(SPRNN_CUDA_ARCHS)
  set(SPRNN_CUDA_ARCHITECTURES "${SPRNN_CUDA_ARCHS}")
elseif(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  set(SPRNN_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
else()
  execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version OUTPUT_VARIABLE _nvcc_version)
  string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _m "${_nvcc_version}")
  set(_cuda_major "${CMAKE_MATCH_1}")
  set(SPRNN_CUDA_ARCHITECTURES "75-real;80-real;90")
  if(_cuda_major AND _cuda_major LESS 13)
    list(PREPEND SPRNN_CUDA_ARCHITECTURES "70-real")
  endif()
endif()
# Keep CMake's own default from overriding ours at enable_language(CUDA).
set(CMAKE_CUDA_ARCHITECTURES "${SPRNN_CUDA_ARCHITECTURES}")
