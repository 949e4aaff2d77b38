# Source on a GPU host that has torch but no CuTeDSL:   source <bundle>/sm_90a/setup_device.sh || exit 1
# Unpacks the CuTeDSL runtime to /tmp/cutedsl-rt, installs the bundled apache-tvm-ffi wheel into
# /tmp/site, and exports NVL72_KERNEL_BUNDLE (this directory), PYTHONPATH (/tmp/site and the current
# directory, i.e. the repository root), LD_LIBRARY_PATH and CUTE_DSL_RUNTIME for later processes.
# Pins NVLink multicast off for NCCL / torch symmetric memory / NVSHMEM (shared test hosts).
_b_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/cutedsl-rt
if [ ! -s /tmp/cutedsl-rt/libcute_dsl_runtime.so ]; then
  python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"), 1<<20)' \
    "$_b_dir/libcute_dsl_runtime.so.xz" /tmp/cutedsl-rt/libcute_dsl_runtime.so.part \
    && mv /tmp/cutedsl-rt/libcute_dsl_runtime.so.part /tmp/cutedsl-rt/libcute_dsl_runtime.so \
    || { echo "setup_device: could not unpack the CuTeDSL runtime" >&2; return 1; }
fi
_b_whl=$(ls "$_b_dir"/apache_tvm_ffi-*.whl)
python3 -c 'from typing_extensions import get_annotations' 2>/dev/null || _b_whl="$_b_whl $(ls "$_b_dir"/typing_extensions-*.whl)"
# shellcheck disable=SC2086
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $_b_whl 2>&1 \
  | grep -v "Running pip as the 'root' user" >&2
[ -f /tmp/site/tvm_ffi/lib/libtvm_ffi.so ] || { echo "setup_device: could not install apache-tvm-ffi" >&2; return 1; }
export NVL72_KERNEL_BUNDLE=$_b_dir
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=/tmp/cutedsl-rt:/tmp/site/tvm_ffi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUTE_DSL_RUNTIME=/tmp/cutedsl-rt/libcute_dsl_runtime.so
unset _b_dir _b_whl
