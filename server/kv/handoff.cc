// KvHandoffGate and the moved-cache status; see handoff.h.
#include "server/kv/handoff.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/kv/kv_pool.h"
#include "spdlog/spdlog.h"

namespace attnserve {

absl::Status MovedStatus(const std::string& cache_id, const std::string& address) {
  absl::Status status =
      absl::UnavailableError(absl::StrCat("cache ", cache_id, " moved to ", address));
  status.SetPayload(kMovedToHeader, absl::Cord(address));
  return status;
}

std::optional<std::string> MovedToOf(const absl::Status& status) {
  const auto address = status.GetPayload(kMovedToHeader);
  if (!address.has_value()) return std::nullopt;
  return std::string(*address);
}

absl::StatusOr<std::string> TokenOfTenant(const std::string& tokens_file,
                                          const std::string& tenant) {
  if (tokens_file.empty()) return std::string();
  std::ifstream in(tokens_file);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat("auth_tokens_file: cannot read '", tokens_file, "'"));
  }
  std::string line;
  while (std::getline(in, line)) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text.front() == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() >= 2 && fields[1] == tenant) return std::string(fields[0]);
  }
  return absl::NotFoundError(
      absl::StrCat("auth_tokens_file: no token names tenant '", tenant, "'"));
}

KvHandoffGate::KvHandoffGate(KvPool* pool, std::string peer, Fetch fetch, Push push)
    : pool_(pool), peer_(std::move(peer)), fetch_(std::move(fetch)), push_(std::move(push)) {}

KvHandoffGate::~KvHandoffGate() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

KvHandoffGate::Pass KvHandoffGate::PassFor(const Key& key) {
  ++entries_[key].passes;
  // The pass's deleter gives the count back; the gate outlives every call.
  return Pass(static_cast<void*>(nullptr), [this, key](void*) { Returned(key); });
}

void KvHandoffGate::Returned(const Key& key) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  if (--it->second.passes == 0) {
    idle_.SignalAll();
    Tidy(key);
  }
}

void KvHandoffGate::Spawn(std::function<void()> work) {
  for (auto it = threads_.begin(); it != threads_.end();) {
    if (finished_.erase(it->get_id()) > 0) {
      it->join();  // past its last use of the gate
      it = threads_.erase(it);
    } else {
      ++it;
    }
  }
  threads_.emplace_back([this, work = std::move(work)] {
    work();
    absl::MutexLock lock(&mu_);
    finished_.insert(std::this_thread::get_id());
  });
}

void KvHandoffGate::Tidy(const Key& key) {
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second.passes == 0 && !it->second.fetching &&
      it->second.waiting.empty()) {
    entries_.erase(it);
  }
}

void KvHandoffGate::Enter(Call call, Go go) {
  const Key key(call.tenant, call.cache_id);
  absl::Status refused;
  Pass pass;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    const bool fetching = it != entries_.end() && it->second.fetching;
    const bool here = !call.create && pool_->Find(call.tenant, call.cache_id).ok();
    const bool gone = moved_.count(key) > 0;  // this server moved it away
    bool wait = fetching || moving_.count(key) > 0;
    bool fetch = false;
    if (call.create) moved_.erase(key);  // a new cache of that id starts here
    if (!wait && !here && !call.create) {
      if (draining_ || (gone && (call.read_only || call.stream))) {
        refused = MovedStatus(call.cache_id, peer_);
        ++counters_.refused_moved;
      } else if (!call.read_only && fetch_ != nullptr) {
        wait = fetch = true;
      }
    } else if (draining_ && call.create && !wait) {
      refused = MovedStatus(call.cache_id, peer_);
      ++counters_.refused_moved;
    }
    if (wait) {
      Entry& entry = entries_[key];
      entry.waiting.push_back({call, std::move(go)});
      if (fetch) {
        entry.fetching = true;
        ++counters_.fetches;
        Spawn([this, call] { RunFetch(call); });
      }
      return;
    }
    if (refused.ok()) pass = PassFor(key);
  }
  go(refused, std::move(pass));
}

void KvHandoffGate::RunFetch(Call call) {
  const absl::Time begin = absl::Now();
  const absl::Status fetched = fetch_(call);
  const Key key(call.tenant, call.cache_id);
  if (fetched.ok()) {
    spdlog::info("handoff: cache {} (tenant {}) fetched from {} in {}", call.cache_id, call.tenant,
                 peer_, absl::FormatDuration(absl::Now() - begin));
  } else if (!absl::IsNotFound(fetched)) {
    absl::MutexLock lock(&mu_);
    ++counters_.failures;
    spdlog::warn("handoff: fetching cache {} (tenant {}) from {} failed: {}", call.cache_id,
                 call.tenant, peer_, fetched.ToString());
  }
  std::vector<Waiting> waiting;
  std::vector<Pass> passes;
  {
    absl::MutexLock lock(&mu_);
    Entry& entry = entries_[key];
    entry.fetching = false;
    waiting.swap(entry.waiting);
    if (fetched.ok()) {
      ++counters_.fetched;
      moved_.erase(key);
      for (size_t i = 0; i < waiting.size(); ++i) passes.push_back(PassFor(key));
    } else if (MovedToOf(fetched).has_value()) {
      counters_.refused_moved += static_cast<int64_t>(waiting.size());
    }
    Tidy(key);
  }
  // A drain that began meanwhile still finds these calls' passes.
  for (size_t i = 0; i < waiting.size(); ++i) {
    waiting[i].go(fetched, fetched.ok() ? std::move(passes[i]) : Pass());
  }
}

std::vector<std::shared_ptr<KvCache>> KvHandoffGate::BeginDrain() {
  // Every cache the pool holds, named by a call or not (made by an import,
  // or at start-up): under mu_, so no call is admitted to one in between.
  absl::MutexLock lock(&mu_);
  draining_ = true;
  std::vector<std::shared_ptr<KvCache>> caches;
  for (std::shared_ptr<KvCache>& cache : pool_->Caches()) {
    // One the peer asked for is moving already (Give).
    if (!moving_.insert(Key(cache->tenant(), cache->id())).second) continue;
    caches.push_back(std::move(cache));
  }
  return caches;
}

bool KvHandoffGate::WaitIdle(const std::string& tenant, const std::string& cache_id,
                             absl::Time deadline) {
  const Key key(tenant, cache_id);
  absl::MutexLock lock(&mu_);
  while (true) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.passes == 0) return true;
    if (idle_.WaitWithDeadline(&mu_, deadline)) {
      it = entries_.find(key);
      return it == entries_.end() || it->second.passes == 0;
    }
  }
}

void KvHandoffGate::Moved(const std::string& tenant, const std::string& cache_id, int64_t bytes) {
  const Key key(tenant, cache_id);
  std::vector<Waiting> waiting;
  {
    absl::MutexLock lock(&mu_);
    moving_.erase(key);
    moved_.insert(key);
    ++counters_.pushed;
    counters_.bytes_pushed += bytes;
    auto it = entries_.find(key);
    if (it != entries_.end()) waiting.swap(it->second.waiting);
    counters_.refused_moved += static_cast<int64_t>(waiting.size());
    Tidy(key);
  }
  for (Waiting& w : waiting) w.go(MovedStatus(cache_id, peer_), Pass());
}

void KvHandoffGate::Release(const std::string& tenant, const std::string& cache_id) {
  const Key key(tenant, cache_id);
  std::vector<Waiting> waiting;
  std::vector<Pass> passes;
  {
    absl::MutexLock lock(&mu_);
    moving_.erase(key);
    ++counters_.failures;
    auto it = entries_.find(key);
    if (it != entries_.end()) waiting.swap(it->second.waiting);
    for (size_t i = 0; i < waiting.size(); ++i) passes.push_back(PassFor(key));
  }
  for (size_t i = 0; i < waiting.size(); ++i) waiting[i].go(absl::OkStatus(), std::move(passes[i]));
}

void KvHandoffGate::Give(const std::string& tenant, const std::string& cache_id,
                         const std::string& authorization,
                         std::function<void(const absl::Status&)> done) {
  absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->Find(tenant, cache_id);
  if (!cache.ok()) return done(cache.status());
  const Key key(tenant, cache_id);
  absl::MutexLock lock(&mu_);
  if (draining_ || moving_.count(key) > 0) {
    return done(absl::UnavailableError(absl::StrCat("cache ", cache_id, " is already moving")));
  }
  moving_.insert(key);
  Spawn([this, cache = *std::move(cache), tenant, cache_id, authorization, done = std::move(done)] {
    const absl::Time begin = absl::Now();
    absl::StatusOr<int64_t> pushed =
        WaitIdle(tenant, cache_id, begin + absl::Seconds(60))
            ? push_(cache, authorization)
            : absl::DeadlineExceededError("calls on the cache still in flight");
    const absl::Status status = pushed.status();
    if (status.ok()) {
      pool_->DropCache(tenant, cache_id).IgnoreError();
      Moved(tenant, cache_id, *pushed);
      spdlog::info("handoff: cache {} (tenant {}) given to {} in {}", cache_id, tenant, peer_,
                   absl::FormatDuration(absl::Now() - begin));
    } else {
      Release(tenant, cache_id);
    }
    done(status);
  });
}

KvHandoffGate::Counters KvHandoffGate::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

int64_t KvHandoffGate::fetched() const {
  absl::MutexLock lock(&mu_);
  return counters_.fetched;
}

int64_t KvHandoffGate::moved() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(moved_.size());
}

}  // namespace attnserve
