// FillServerTiming: the executor's WorkTimings as the wire's ServerTiming, for
// every front-end that answers with one (Forward, AppendAttend).
#pragma once

#include "attnserve/v1/attention.pb.h"
#include "server/executor.h"

namespace attnserve {

inline void FillServerTiming(const WorkTimings& timings, v1::ServerTiming* t) {
  t->set_queue_us(timings.queue_us);
  t->set_host_to_device_us(timings.host_to_device_us);
  t->set_compute_us(timings.compute_us);
  t->set_device_to_host_us(timings.device_to_host_us);
  t->set_total_us(timings.total_us);
  t->set_batch_size(timings.batch_size);
  t->set_device(timings.device);
}

}  // namespace attnserve
