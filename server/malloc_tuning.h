// Moved to common/malloc_tuning.h; this forwarding header goes once
// server/main.cc and server/metrics.cc include that one.
#pragma once

#include "common/malloc_tuning.h"
