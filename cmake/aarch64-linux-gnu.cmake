# Cross build for aarch64 Linux with Debian's cross compiler
# (apt-get install g++-aarch64-linux-gnu); used by .ci/arm_emulation.sh:
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake ...
# Programs built with it run on x86 under qemu-aarch64 (apt-get install qemu-user).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(PAGED_CROSS_TRIPLE aarch64-linux-gnu CACHE STRING "GNU triple of the cross compiler")
set(CMAKE_C_COMPILER ${PAGED_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${PAGED_CROSS_TRIPLE}-g++)
set(CMAKE_FIND_ROOT_PATH /usr/${PAGED_CROSS_TRIPLE} /usr/lib/${PAGED_CROSS_TRIPLE})
# Programs (python, nvcc) from the host; headers and libraries from the target.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
