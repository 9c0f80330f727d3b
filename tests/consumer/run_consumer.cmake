# Driver for the consumer tests (see CMakeLists.txt). cmake -DMODE=install|subdirectory -DWORK=... -P
cmake_minimum_required(VERSION 3.25)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${what} failed (rc ${rc}):\n  ${ARGN}\n${out}")
  endif()
  message(STATUS "consumer (${MODE}): ${what}: ok")
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

set(cfg -S ${PROJECT_DIR} -B ${WORK}/build -G Ninja "-DCMAKE_CXX_COMPILER=${CXX}")
if(BUILD_TYPE)
  list(APPEND cfg "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
endif()
if(CCACHE)
  list(APPEND cfg "-DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE}")
endif()
if(SANITIZE)
  # A sanitized typegrad_cpu needs the sanitizer runtime at the consumer's link too.
  list(APPEND cfg "-DCMAKE_CXX_FLAGS=-fsanitize=${SANITIZE}" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=${SANITIZE}")
endif()

if(MODE STREQUAL "install")
  set(prefix ${WORK}/prefix)
  run("cmake --install" ${CMAKE_COMMAND} --install ${MAIN_BINARY_DIR} --prefix ${prefix})
  foreach(f include/typegrad/typegrad.hpp include/typegrad/config.hpp)
    if(NOT EXISTS ${prefix}/${f})
      message(FATAL_ERROR "consumer (install): ${prefix}/${f} was not installed")
    endif()
  endforeach()
  # Only the prefix: the consumer must not see the source or build tree.
  list(APPEND cfg "-DCMAKE_PREFIX_PATH=${prefix}" -DTG_CONSUMER_MODE=find_package)
elseif(MODE STREQUAL "subdirectory")
  list(APPEND cfg -DTG_CONSUMER_MODE=subdirectory "-DTG_CONSUMER_TYPEGRAD_DIR=${MAIN_SOURCE_DIR}"
       -DTG_BUILD_TESTS=OFF -DTG_BUILD_BENCHMARKS=OFF -DTG_BUILD_EXAMPLES=OFF -DTG_CUDA=OFF
       "-DTG_NATIVE=${TG_NATIVE}")
else()
  message(FATAL_ERROR "run_consumer.cmake: MODE must be install or subdirectory, got '${MODE}'")
endif()

run("configure" ${CMAKE_COMMAND} ${cfg})
run("build" ${CMAKE_COMMAND} --build ${WORK}/build -j2)
run("run" ${WORK}/build/tg_consumer)
message("${run_output}")
