// CRC-32C (Castagnoli, the iSCSI/ext4 polynomial 0x1EDC6F41, reflected),
// the checksum of a K/V transfer's chunks (kv_transfer.proto). SSE4.2's crc32
// instruction when the CPU has it (checked once at run time), else a
// slicing-by-8 table; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attnserve {

// Extends `crc` (the value of the bytes before, 0 for none) over `size` bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);
inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

// The table form alone, and whether Crc32cExtend uses the instruction (tests).
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size);
bool Crc32cHardware();

}  // namespace attnserve
