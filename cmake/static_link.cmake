# attnserve_link_static(target): with ATTNSERVE_STATIC, links `target` against
# static archives so it runs on a machine without gRPC, protobuf or Abseil
# (the GPU machine, a slim container).
#
# Debian's CMake packages import only shared libraries, so every imported
# library in the target's link closure is pointed at the archive beside it
# (libfoo.so.N -> libfoo.a); the link fails loudly if one is missing.
#
# Without CUDA the result is fully static (-static). With CUDA, glibc stays
# dynamic (-static-libstdc++ -static-libgcc only): cudart_static dlopen()s the
# driver's libcuda.so, which a statically linked glibc cannot do reliably (a
# fully static attnserve crashed in CUDA initialisation on an H100).
# Some imported targets (re2::re2 from pkg-config) list bare library names
# such as "re2"; -static would turn those into archives, a glibc-dynamic link
# does not, so name the archive explicitly. glibc's own libraries stay as named.
function(_attnserve_plain_names_to_archives target)
  get_target_property(libs ${target} INTERFACE_LINK_LIBRARIES)
  if(NOT libs)
    return()
  endif()
  set(rewritten)
  foreach(lib ${libs})
    string(REGEX REPLACE "^-l" "" name "${lib}")
    if(NOT TARGET ${lib} AND name MATCHES "^[A-Za-z0-9_+.-]+$"
       AND NOT name MATCHES "^(c|m|dl|rt|pthread|util|resolv)$")
      find_library(archive_${name} NAMES lib${name}.a)
      if(archive_${name})
        set(lib "${archive_${name}}")
      endif()
    endif()
    list(APPEND rewritten "${lib}")
  endforeach()
  set_target_properties(${target} PROPERTIES INTERFACE_LINK_LIBRARIES "${rewritten}")
endfunction()

function(attnserve_link_static target)
  if(NOT ATTNSERVE_STATIC)
    return()
  endif()
  set(queue ${target})
  set(seen ${target})
  while(queue)
    list(POP_FRONT queue current)
    get_target_property(imported ${current} IMPORTED)
    if(imported)
      foreach(prop IMPORTED_LOCATION IMPORTED_LOCATION_NONE IMPORTED_LOCATION_NOCONFIG
                   IMPORTED_LOCATION_RELEASE)
        get_target_property(location ${current} ${prop})
        if(location MATCHES "\\.so(\\.[0-9]+)*$")
          string(REGEX REPLACE "\\.so(\\.[0-9]+)*$" ".a" archive "${location}")
          if(EXISTS "${archive}")
            set_target_properties(${current} PROPERTIES ${prop} "${archive}")
          endif()
        endif()
      endforeach()
    endif()
    if(imported)
      _attnserve_plain_names_to_archives(${current})
    endif()
    set(deps)
    foreach(prop INTERFACE_LINK_LIBRARIES LINK_LIBRARIES)
      get_target_property(d ${current} ${prop})
      if(d)
        list(APPEND deps ${d})
      endif()
    endforeach()
    foreach(dep ${deps})
      string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" dep "${dep}")
      if(TARGET ${dep} AND NOT dep IN_LIST seen)
        list(APPEND seen ${dep})
        list(APPEND queue ${dep})
      endif()
    endforeach()
  endwhile()
  if(ATTNSERVE_HAVE_CUDA)
    target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc)
  else()
    target_link_options(${target} PRIVATE -static)
  endif()
endfunction()
