// A CPU emulation of the GPU prelude, so the shared GEMV body runs on the host
// (tests/test_kernels_cuda.py compiles it with g++ -fsanitize=address and
// checks it against gearbx_mlx.quant.reference_matmul). Each GPU thread is a
// std::thread; SIMD-group sums and threadgroup barriers are std::barrier
// rendezvous. Slow, but it runs the very text that runs on Metal and CUDA,
// with out-of-bounds reads caught by the sanitizer.
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define GBX_HOST 1
#define GBX_DEVICE
// One copy per kernel instantiation, shared by the threads of the (single)
// threadgroup in flight: threadgroups run one after another.
#define GBX_SHARED static
#define GBX_SHARED_PTR
#define GBX_FN inline
#define GBX_UNROLL
#define GBX_AS_FLOAT(u) gbx_emu_as_float(u)
#define GBX_SIMD_SUM(v) gbx_emu_simd_sum(v)
#define GBX_BARRIER() gbx_emu_block_barrier()
#define GBX_ROUND(x) std::round(x)
#define GBX_RINT(x) std::rint(x)
#define GBX_FABS(x) std::fabs(x)
#define GBX_FMIN(a, b) std::fmin(a, b)
#define GBX_FMAX(a, b) std::fmax(a, b)
#define GBX_FMUL(a, b) ((a) * (b))

struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

typedef _Float16 gbx_half_t;
// bfloat16 with round-to-nearest-even from float, as GPUs convert.
struct gbx_bfloat_t {
  uint16_t bits;
  gbx_bfloat_t() = default;
  gbx_bfloat_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

inline float gbx_emu_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float2 gbx_half2_bits_to_float2(unsigned int u) {
  _Float16 h[2];
  std::memcpy(h, &u, 4);
  return float2{float(h[0]), float(h[1])};
}

// Per-threadgroup rendezvous state, and each emulated thread's indices.
struct GbxEmuGroup {
  std::barrier<> block{256};
  std::array<std::barrier<>*, 8> warp{};
  float slots[256];
  GbxEmuGroup() {
    for (auto& w : warp) w = new std::barrier<>(32);
  }
  ~GbxEmuGroup() {
    for (auto* w : warp) delete w;
  }
};
inline GbxEmuGroup* gbx_emu_group = nullptr;
inline thread_local int gbx_emu_tid = 0;
inline thread_local int gbx_emu_block = 0;

inline void gbx_emu_block_barrier() { gbx_emu_group->block.arrive_and_wait(); }

inline float gbx_emu_simd_sum(float v) {
  const int warp = gbx_emu_tid >> 5;
  gbx_emu_group->slots[gbx_emu_tid] = v;
  gbx_emu_group->warp[warp]->arrive_and_wait();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += gbx_emu_group->slots[warp * 32 + i];
  // Nobody overwrites a slot before every lane has read the warp's values.
  gbx_emu_group->warp[warp]->arrive_and_wait();
  return s;
}

// Run `kernel(args...)` on n_groups threadgroups of 256 threads, one group
// at a time. `kernel` reads its indices through the entry below.
template <typename F>
void gbx_emu_launch(int n_groups, F kernel) {
  for (int g = 0; g < n_groups; ++g) {
    GbxEmuGroup group;
    gbx_emu_group = &group;
    std::vector<std::thread> threads;
    threads.reserve(256);
    for (int t = 0; t < 256; ++t) {
      threads.emplace_back([=] {
        gbx_emu_tid = t;
        gbx_emu_block = g;
        kernel();
      });
    }
    for (auto& th : threads) th.join();
  }
  gbx_emu_group = nullptr;
}

// The entry (indices), as entry_cuda.inc spells it for CUDA.
#define GBX_HOST_ENTRY                          \
  const int gbx_tid = gbx_emu_tid;              \
  const int gbx_lane = gbx_tid & 31;            \
  const int gbx_warp = gbx_tid >> 5;            \
  const int gbx_group = gbx_emu_block;

// -- matrix-unit variant (gemv_mma_body.inc), emulated as on Metal ------------
#define GBX_THREAD
typedef float2 gbx_apair;

template <typename T>
inline gbx_apair gbx_i4_pair(unsigned int u) {
  return float2{float(u & 0xFu) - float(GBX_INT4_OFFSET), float((u >> 16) & 0xFu) - float(GBX_INT4_OFFSET)};
}

template <typename T>
inline float2 gbx_x_pair(unsigned int u);
template <>
inline float2 gbx_x_pair<gbx_half_t>(unsigned int u) {
  return gbx_half2_bits_to_float2(u);
}
template <>
inline float2 gbx_x_pair<gbx_bfloat_t>(unsigned int u) {
  return float2{gbx_emu_as_float(u << 16), gbx_emu_as_float(u & 0xFFFF0000u)};
}

template <typename T>
inline void gbx_mma(float (&c)[4], const gbx_apair (&a)[4], unsigned int b0, unsigned int b1) {
  const float2 x0 = gbx_x_pair<T>(b0);
  const float2 x1 = gbx_x_pair<T>(b1);
  c[0] += a[0].x * x0.x + a[0].y * x0.y + a[2].x * x1.x + a[2].y * x1.y;
  c[2] += a[1].x * x0.x + a[1].y * x0.y + a[3].x * x1.x + a[3].y * x1.y;
}

// Sum over the four lanes of a row, through the warp's rendezvous slots.
inline float gbx_quad_sum(float v) {
  const int warp = gbx_emu_tid >> 5;
  gbx_emu_group->slots[gbx_emu_tid] = v;
  gbx_emu_group->warp[warp]->arrive_and_wait();
  const int q = gbx_emu_tid & ~3;
  float s = 0.0f;
  for (int i = 0; i < 4; ++i) s += gbx_emu_group->slots[q + i];
  gbx_emu_group->warp[warp]->arrive_and_wait();
  return s;
}

// The test harnesses' input: a whole file's bytes (empty if it cannot be opened).
static std::vector<char> gbx_host_slurp(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return {};
  std::fseek(f, 0, SEEK_END);
  long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<char> v(n);
  if (n && std::fread(v.data(), 1, n, f) != size_t(n)) std::abort();
  std::fclose(f);
  return v;
}

// The test harnesses' output: the bytes of v as the whole file at path (abort if it cannot be written).
static void gbx_host_spill(const std::string& path, const std::vector<char>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(v.data(), 1, v.size(), f) != v.size()) std::abort();
  std::fclose(f);
}
