# Writes CTEST_FILE: one CTest test per GoogleTest suite of TEST_EXECUTABLE (named "<Suite>.*", run with
# --gtest_filter=<Suite>.*), labelled LABELS. Run after each build of the executable (tests/CMakeLists.txt,
# tg_add_suite_test). For executables whose every process pays a long start-up (test_ops loads the CUDA
# libraries: about 0.1 s before its first test), so that CTest starts one process per suite, not per test.
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE listing_err RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}): ${listing_err}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(out "")
set(count 0)
foreach(line IN LISTS lines)
  # suite lines start in column 0 and end with '.' (a typed suite's comment may follow); test lines are indented
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND out "add_test([=[${suite}.*]=] \"${TEST_EXECUTABLE}\" [=[--gtest_filter=${suite}.*]=])\n")
    string(APPEND out "set_tests_properties([=[${suite}.*]=] PROPERTIES LABELS \"${LABELS}\")\n")
    math(EXPR count "${count} + 1")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no test suite")
endif()
file(WRITE "${CTEST_FILE}" "${out}")
