# Warnings on everywhere for our own targets; kvlens_set_warnings(target) applies them.
function(kvlens_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow=local -Wnon-virtual-dtor
      -Wno-missing-field-initializers>)
  if(KVLENS_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()
