// EncodeRowsTensorMap (attn_fwd_sm90.h): TMA tensor maps for the Hopper
// kernels, encoded by the driver's cuTensorMapEncodeTiled found at run time
// through the CUDA runtime, so the binary needs no libcuda at link or start.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "backend/cuda/hopper/attn_fwd_sm90.h"

namespace attnserve {
namespace cuda {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's entry point, looked up once (12.0: the first version with it).
EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

}  // namespace

cudaError_t EncodeRowsTensorMap(CUtensorMap* map, const void* base, DType dtype, int64_t batch,
                                int64_t rows, int64_t heads, int64_t head_dim, int box_rows) {
  const EncodeTiledFn encode = EncodeTiled();
  if (encode == nullptr) return cudaErrorInvalidValue;
  // A box row is one 128-byte swizzle row: 64 16-bit or 128 FP8 elements.
  const int64_t elem_bytes = dtype == DType::kFP8E4M3 ? 1 : 2;
  const CUtensorMapDataType type = dtype == DType::kFP8E4M3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : dtype == DType::kFP16  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                            : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  // Dims innermost first: head_dim, heads, rows, batch. Rows past a
  // sequence's end and columns past head_dim read as zeros (out of bounds).
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim * elem_bytes),
                                 static_cast<cuuint64_t>(heads * head_dim * elem_bytes),
                                 static_cast<cuuint64_t>(rows * heads * head_dim * elem_bytes)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / elem_bytes), 1,
                             static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t EncodeVtTensorMap(CUtensorMap* map, const void* base, int64_t width, int64_t head_dim,
                              int64_t heads, int box_cols, int box_rows) {
  const EncodeTiledFn encode = EncodeTiled();
  if (encode == nullptr || (box_cols != 128 && box_cols != 64)) return cudaErrorInvalidValue;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(width), static_cast<cuuint64_t>(head_dim),
                              static_cast<cuuint64_t>(heads), 1};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(width),
                                 static_cast<cuuint64_t>(width * head_dim),
                                 static_cast<cuuint64_t>(width * head_dim * heads)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows),
                             1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             box_cols == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

namespace {

// (base, dtype, rows, heads, head_dim, box_rows): everything a map encodes.
struct MapKey {
  const void* base;
  int dtype;
  int64_t rows, heads, head_dim;
  int box_rows;
  bool operator==(const MapKey& o) const {
    return std::tie(base, dtype, rows, heads, head_dim, box_rows) ==
           std::tie(o.base, o.dtype, o.rows, o.heads, o.head_dim, o.box_rows);
  }
};
struct MapKeyHash {
  size_t operator()(const MapKey& k) const {
    size_t h = std::hash<const void*>()(k.base);
    for (int64_t x : {int64_t{k.dtype}, k.rows, k.heads, k.head_dim, int64_t{k.box_rows}}) {
      h = h * 1000003u ^ std::hash<int64_t>()(x);
    }
    return h;
  }
};
// A slab freed and another allocated at its address with the same geometry
// gets the same map, which is right: a map holds no more than the key.
// Bounded: cleared when it reaches kMaxCachedMaps (a few caches' slabs).
constexpr size_t kMaxCachedMaps = 4096;

}  // namespace

cudaError_t CachedRowsTensorMap(CUtensorMap* map, const void* base, DType dtype, int64_t rows,
                                int64_t heads, int64_t head_dim, int box_rows) {
  static std::mutex mu;
  static std::unordered_map<MapKey, CUtensorMap, MapKeyHash>* cache =
      new std::unordered_map<MapKey, CUtensorMap, MapKeyHash>();
  const MapKey key{base, static_cast<int>(dtype), rows, heads, head_dim, box_rows};
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache->find(key);
  if (it != cache->end()) {
    std::memcpy(map, &it->second, sizeof(CUtensorMap));
    return cudaSuccess;
  }
  const cudaError_t err = EncodeRowsTensorMap(map, base, dtype, 1, rows, heads, head_dim, box_rows);
  if (err != cudaSuccess) return err;
  if (cache->size() >= kMaxCachedMaps) cache->clear();
  cache->emplace(key, *map);
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace attnserve
