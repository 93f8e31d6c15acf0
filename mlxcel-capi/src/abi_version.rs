// The ABI version of libmlxcel: the one place it is set. build.rs includes
// this file for the SONAME (`libmlxcel.so.<MAJOR>`), cbindgen copies the
// constants into include/mlxcel.h, and `mlxcel_abi_version()` returns them.

/// The major version of the ABI this header describes. It changes when a
/// function's signature or a struct's layout changes incompatibly; a program
/// must only run against a library with the same major version. It is also
/// the version in the shared library's SONAME, `libmlxcel.so.<MAJOR>`.
pub const MLXCEL_ABI_VERSION_MAJOR: u32 = 7;
/// The minor version of the ABI: it grows when functions or constants are
/// added; a program built against minor N runs against any library of the
/// same major version and minor >= N.
pub const MLXCEL_ABI_VERSION_MINOR: u32 = 1;
