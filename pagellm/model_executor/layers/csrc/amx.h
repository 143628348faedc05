// AMX set-up shared by the tile kernels: Linux's per-process permission and the tile configuration.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define PAGELLM_AMX 1

namespace pagellm {

// Linux hands out AMX tile state on request (once per process).
inline bool request_amx() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures this thread's tiles 0-7 as 16 rows x 64 bytes each. The config is a static object: built on the
// stack and inlined, GCC dropped the stores that only ldtilecfg reads and left the tiles unconfigured, so the
// first tile load faulted (SIGILL).
inline void configure_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&config);
}

}  // namespace pagellm
#endif
