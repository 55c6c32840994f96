// The checks of a call's score modifiers and masks (ALiBi slopes, sinks, bias,
// element mask, block mask; AttentionOptions fields 10..14), after the call's
// shapes, lengths and options passed (validate.h). Errors name the field
// through the front-end's FieldNames. Every check is linear in what the call
// sent (the bias is scanned once, the block mask's rows and columns once), so
// --max_request_bytes bounds their cost too.
#pragma once

#include "absl/status/statusor.h"
#include "backend/make_params.h"
#include "backend/params.h"
#include "server/core/call.h"
#include "server/core/field_names.h"

namespace attnserve {

// `mods` against the call `p` describes (sizes, lengths and cu_seqlens
// already valid; p's own mods unused): INVALID_ARGUMENT naming the first bad
// field, or the AttnMods pointing into `mods`' memory with the broadcast
// flags the shapes imply.
absl::StatusOr<AttnMods> ValidateScoreMods(const ScoreModsView& mods, const AttnParams& p,
                                           const FieldNames& names);

// Hq of a K/V call: q's heads; a call without q (no queries) takes it from
// its ALiBi slopes or sinks when it sends them (ValidateKvScoreMods checks
// that it is a multiple of Hkv), else Hkv.
int64_t KvCallHeadsQ(const KvCall& call, int64_t num_heads_kv);

// The score modifiers of a K/V call (shapes already valid): ALiBi slopes and
// sinks, Hq finite values each (KvCallHeadsQ); ALiBi not with any step's
// attend_pages (the compacted keys' positions are not the sequence's); a
// bias (FP32, FP16 or BF16) and element mask laid out [Hq or 1, P], P = the
// sum over the steps of num_queries x (expected_length + num_new_tokens), each
// sequence's query rows over its whole history after the append, not with
// attend_pages and only with each step's expected_length (check_lengths); a
// block mask refused ("use attend_pages for page-level sparsity").
// INVALID_ARGUMENT naming the first bad field.
absl::Status ValidateKvScoreMods(const KvCall& call, int64_t num_heads_kv, const FieldNames& names);

// A valid K/V call's bias and element mask into `mods` (varlen, per head
// unless their first dim is 1); the rest of `mods` is left as it is.
void SetKvElementMasks(const KvCall& call, AttnMods* mods);

}  // namespace attnserve
