# Finds libjpeg-turbo's TurboJPEG API (turbojpeg.h, libturbojpeg) and its libjpeg API (jpeglib.h,
# libjpeg) on the machine that runs CMake, and defines them as imported targets:
#   splitflow_deps::turbojpeg   splitflow_deps::jpeg
# Used to build splitflow and, installed beside splitflowConfig.cmake, by its consumers, so that
# the installed package names targets, not the build machine's library paths.
find_path(SPLITFLOW_TURBOJPEG_INCLUDE_DIR turbojpeg.h)
find_library(SPLITFLOW_TURBOJPEG_LIBRARY turbojpeg)
find_path(SPLITFLOW_JPEG_INCLUDE_DIR jpeglib.h)
find_library(SPLITFLOW_JPEG_LIBRARY jpeg)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(SplitflowJPEG
  REQUIRED_VARS SPLITFLOW_TURBOJPEG_LIBRARY SPLITFLOW_TURBOJPEG_INCLUDE_DIR
                SPLITFLOW_JPEG_LIBRARY SPLITFLOW_JPEG_INCLUDE_DIR)
if(SplitflowJPEG_FOUND)
  foreach(lib turbojpeg jpeg)
    string(TOUPPER ${lib} up)
    if(NOT TARGET splitflow_deps::${lib})
      add_library(splitflow_deps::${lib} UNKNOWN IMPORTED)
      set_target_properties(splitflow_deps::${lib} PROPERTIES
        IMPORTED_LOCATION "${SPLITFLOW_${up}_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${SPLITFLOW_${up}_INCLUDE_DIR}")
    endif()
  endforeach()
endif()
