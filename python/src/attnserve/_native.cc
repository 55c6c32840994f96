// attnserve._native: the tensor-carrying calls (unary and streams) through gRPC C++, not grpcio.
//
// Why (bench/NOTES-python.md): grpcio takes a request only as one
// `bytes` and copies it into its own buffer, and hands a response over after
// copying it three times (a `bytes` per received slice, a bytearray, then
// `bytes` of that), all fresh allocations that a loaded machine faults in
// page by page. Here a request goes out as gRPC slices that reference the
// caller's buffers (attnserve._wire's pieces: the small message, each
// tensor's header and the tensor's own memory: no copy; a stream message is
// copied once, at submit, since the caller may reuse its arrays), and a response
// comes back as one `bytes` filled from gRPC's slices (one copy, the one
// attnctl's protobuf parse makes too), both outside the GIL.
//
// What it is not: the wire format (attnserve._wire builds every byte of a
// request and parses every response), the choice of transport
// (attnserve._transport), or the other RPCs (grpcio's, unchanged).
//
//   ch = Channel(target, [(name, int | str), ...])     # plain-text channel, grpcio's options
//   code, payload = ch.unary("/pkg.Svc/Method", pieces, timeout_s | None, [(key, value)] | None)
//     code 0: payload is the response's bytes; else the gRPC status code and
//     payload its message (str). ch.calls: calls completed so far; ch.close().
//   call = ch.start_unary(path, pieces, timeout, metadata, on_done)
//     the same call without waiting: on_done(code, payload) runs later on the
//     channel's completion thread (with the GIL); call.cancel().
//   call = ch.start_stream(path, timeout, metadata, on_read, on_done)
//     a bidirectional stream: call.write(pieces) queues one message (its bytes
//     copied now, so the caller may reuse its arrays), call.writes_done(),
//     call.cancel(); on_read(bytes) runs for each response in order, then
//     on_done(code, message) once.
//
// The asynchronous forms run on one completion queue per channel, drained by
// one thread of this module (started on the first such call). It hands each
// completion to Python by calling the callback with the GIL taken; an asyncio
// caller passes loop.call_soon_threadsafe-bound callbacks, so the event loop
// is woken by its own self-pipe, never polled.
//
// Public gRPC C++ API only (no grpcpp/impl, no grpc::internal): a call is a
// generic stub's unary call (grpc::GenericStub: ByteBuffer in and out, the
// method by its path) on a completion queue of its own, waited on in place.
// A ByteBuffer request is taken by reference to its slices and a response
// handed over by swapping its slices, so neither side copies bytes.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/slice.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

// The caller's buffers a request's slices point into, released (under the
// GIL) once the call and every slice are done with them. gRPC may drop its
// last reference to a slice on one of its own threads, and even after the
// call returned; such a release is queued (no Python from gRPC's threads)
// and done by the next call or close() in a Python thread.
struct HeldBuffers {
  std::atomic<int> refs{1};  // the calling thread's, plus one per slice
  std::vector<Py_buffer> views;

  void ReleaseHoldingGil() {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
    delete this;
  }
  static void Unref(void* arg);  // a slice's destroy function: any thread, no GIL
  void UnrefHoldingGil() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) ReleaseHoldingGil();
  }
};

std::mutex late_mu;
std::vector<HeldBuffers*>* late = new std::vector<HeldBuffers*>;  // never freed: see Unref

void HeldBuffers::Unref(void* arg) {
  auto* held = static_cast<HeldBuffers*>(arg);
  if (held->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::lock_guard<std::mutex> lock(late_mu);
  late->push_back(held);
}

// Releases what gRPC let go of after its call returned (GIL held).
void ReleaseLate() {
  std::vector<HeldBuffers*> done;
  {
    std::lock_guard<std::mutex> lock(late_mu);
    if (late->empty()) return;
    done.swap(*late);
  }
  for (HeldBuffers* held : done) held->ReleaseHoldingGil();
}

// -- asynchronous calls -------------------------------------------------------

// Calls fn(*args) with the GIL held; there is no Python caller on the
// completion thread, so an exception is reported, not raised. Steals args.
void CallPython(PyObject* fn, PyObject* args) {
  if (args == nullptr) {
    PyErr_WriteUnraisable(fn);
    return;
  }
  PyObject* result = PyObject_Call(fn, args, nullptr);
  Py_DECREF(args);
  if (result == nullptr) {
    PyErr_WriteUnraisable(fn);
  } else {
    Py_DECREF(result);
  }
}

// Copies under this many bytes are not worth giving the GIL away for.
constexpr size_t kCopyWithoutGil = 256 << 10;

// A received message as one `bytes` (GIL held; a large copy runs without it).
PyObject* BytesOf(grpc::ByteBuffer* buffer) {
  std::vector<grpc::Slice> parts;
  if (!buffer->Dump(&parts).ok()) parts.clear();
  size_t total = 0;
  for (const grpc::Slice& s : parts) total += s.size();
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (out == nullptr) return nullptr;
  char* at = PyBytes_AS_STRING(out);
  auto copy = [&] {
    for (const grpc::Slice& s : parts) {
      std::memcpy(at, s.begin(), s.size());
      at += s.size();
    }
    parts.clear();
    buffer->Clear();
  };
  if (total >= kCopyWithoutGil) {
    Py_BEGIN_ALLOW_THREADS copy();
    Py_END_ALLOW_THREADS
  } else {
    copy();
  }
  return out;
}

PyObject* MessageOf(const grpc::Status& status) {
  const std::string& message = status.error_message();
  return PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "replace");
}

class Engine;
struct AsyncCall;

// A completion queue tag: which operation of which call completed.
struct Op {
  enum Kind { kStart, kRead, kWrite, kWritesDone, kFinish };
  AsyncCall* call;
  Kind kind;
};

// One asynchronous call, unary or stream. The engine holds it until its last
// operation completed, the Python Call object while that lives. Its
// callbacks are dropped (with the GIL) once on_done ran, so whichever owner
// lets go last may do so without the GIL.
struct AsyncCall {
  explicit AsyncCall(Engine* e) : engine(e) {}

  Engine* engine;
  grpc::ClientContext context;  // declared before the call objects: they go first
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> unary;
  PyObject* on_read = nullptr;  // owned; streams only
  PyObject* on_done = nullptr;  // owned
  Op start{this, Op::kStart}, read{this, Op::kRead}, write{this, Op::kWrite},
      writes_done{this, Op::kWritesDone}, finish{this, Op::kFinish};
  grpc::ByteBuffer incoming;  // the response being read
  grpc::Status status;

  std::mutex mu;                        // guards what follows; never held while taking the GIL
  std::deque<grpc::ByteBuffer> queued;  // front: the one being written while `writing`
  bool started = false, writing = false, want_writes_done = false, writes_done_sent = false,
       broken = false, finishing = false, finished = false;
  int outstanding = 0;  // operations started and not completed

  void Complete(Op::Kind kind, bool ok);  // the completion thread, no GIL
  bool Write(grpc::ByteBuffer message);   // false once the stream cannot take more
  void WritesDone();

 private:
  void NextWriteLocked();
  void FinishLocked();
  void DeliverDone();
};

// A channel's asynchronous calls: one completion queue and the thread that
// drains it.
class Engine {
 public:
  // `calls` is shared: an engine closed from its own thread outlives the channel object.
  Engine(std::shared_ptr<grpc::Channel> channel, std::shared_ptr<std::atomic<long long>> calls)
      : channel_(std::move(channel)), calls_(std::move(calls)), thread_([this] { Run(); }) {}

  grpc::CompletionQueue* cq() { return &cq_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  std::atomic<long long>* calls() { return calls_.get(); }

  // Takes the engine's reference to a call before its first operation; false once closing.
  bool Add(const std::shared_ptr<AsyncCall>& call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) return false;
    live_.emplace(call.get(), call);
    return true;
  }

  // A call's last operation completed: drops the engine's reference.
  void Done(AsyncCall* call) {
    std::shared_ptr<AsyncCall> last;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(call);
    if (it == live_.end()) return;
    last = std::move(it->second);
    live_.erase(it);
    if (closing_ && live_.empty()) cq_.Shutdown();
  }

  // Cancels every call, lets each finish, stops the thread. Called without the
  // GIL (the thread needs it to hand the last completions over). Returns false
  // when called from the engine's own thread (a callback closing the channel):
  // the thread then ends by itself and the engine must be left to it.
  bool Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!closing_) {
        closing_ = true;
        for (auto& entry : live_) entry.second->context.TryCancel();
        if (live_.empty()) cq_.Shutdown();
      }
    }
    if (std::this_thread::get_id() == thread_.get_id()) {
      thread_.detach();
      return false;
    }
    if (thread_.joinable()) thread_.join();
    return true;
  }

 private:
  void Run() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
      Op* op = static_cast<Op*>(tag);
      op->call->Complete(op->kind, ok);
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<std::atomic<long long>> calls_;
  grpc::CompletionQueue cq_;
  std::mutex mu_;
  bool closing_ = false;
  std::map<AsyncCall*, std::shared_ptr<AsyncCall>> live_;
  std::thread thread_;  // last: started once the rest is built
};

void AsyncCall::NextWriteLocked() {
  if (!started || writing || broken || finishing) return;
  if (!queued.empty()) {
    writing = true;
    ++outstanding;
    stream->Write(queued.front(), &write);
  } else if (want_writes_done && !writes_done_sent) {
    writes_done_sent = true;
    ++outstanding;
    stream->WritesDone(&writes_done);
  }
}

void AsyncCall::FinishLocked() {
  finishing = true;
  ++outstanding;
  stream->Finish(&status, &finish);
}

void AsyncCall::DeliverDone() {
  PyGILState_STATE gil = PyGILState_Ensure();
  ReleaseLate();
  engine->calls()->fetch_add(1, std::memory_order_relaxed);
  PyObject* args = nullptr;
  if (status.ok() && unary) {
    PyObject* payload = BytesOf(&incoming);
    args = payload == nullptr ? nullptr : Py_BuildValue("(iN)", 0, payload);
  } else {
    args = Py_BuildValue("(iN)", static_cast<int>(status.error_code()), MessageOf(status));
  }
  CallPython(on_done, args);
  Py_CLEAR(on_done);
  Py_CLEAR(on_read);
  PyGILState_Release(gil);
}

void AsyncCall::Complete(Op::Kind kind, bool ok) {
  if (kind == Op::kRead && ok) {
    // Handed over before the next read is started, so responses stay in order.
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* payload = BytesOf(&incoming);
    CallPython(on_read, payload == nullptr ? nullptr : Py_BuildValue("(N)", payload));
    PyGILState_Release(gil);
  } else if (kind == Op::kFinish) {
    DeliverDone();
  }
  std::unique_lock<std::mutex> lock(mu);
  --outstanding;
  switch (kind) {
    case Op::kStart:
      started = true;
      if (!ok) {
        FinishLocked();
        break;
      }
      ++outstanding;
      stream->Read(&incoming, &read);
      NextWriteLocked();
      break;
    case Op::kRead:
      if (ok) {
        ++outstanding;
        stream->Read(&incoming, &read);
      } else {
        FinishLocked();  // the server ended its side: its status is next
      }
      break;
    case Op::kWrite:
      writing = false;
      queued.pop_front();
      if (!ok) {
        broken = true;  // the call is over; the read side reports its status
        queued.clear();
      }
      NextWriteLocked();
      break;
    case Op::kWritesDone: break;
    case Op::kFinish: finished = true; break;
  }
  if (finished && outstanding == 0) {
    lock.unlock();
    engine->Done(this);  // may destroy this call: nothing of it is touched after
  }
}

bool AsyncCall::Write(grpc::ByteBuffer message) {
  std::lock_guard<std::mutex> lock(mu);
  if (broken || finishing || want_writes_done) return false;
  queued.push_back(std::move(message));
  NextWriteLocked();
  return true;
}

void AsyncCall::WritesDone() {
  std::lock_guard<std::mutex> lock(mu);
  want_writes_done = true;
  NextWriteLocked();
}

// The Python handle of an asynchronous call.
struct CallObject {
  PyObject_HEAD std::shared_ptr<AsyncCall>* call;
};

PyTypeObject kCallType = {PyVarObject_HEAD_INIT(nullptr, 0)};

void CallDealloc(CallObject* self) {
  delete self->call;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// One message of the pieces' bytes, copied now (large copies without the GIL).
bool CopiedMessage(PyObject* pieces, grpc::ByteBuffer* out) {
  PyObject* seq = PySequence_Fast(pieces, "pieces: expected a sequence of buffers");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<Py_buffer> views;
  views.reserve(n);
  size_t total = 0;
  bool ok = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_buffer view;
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_C_CONTIGUOUS) != 0) {
      ok = false;
      break;
    }
    views.push_back(view);
    total += static_cast<size_t>(view.len);
  }
  if (ok) {
    grpc::Slice slice(total);
    auto* at = const_cast<uint8_t*>(slice.begin());  // a fresh slice of ours
    auto copy = [&] {
      for (const Py_buffer& v : views) {
        std::memcpy(at, v.buf, static_cast<size_t>(v.len));
        at += v.len;
      }
    };
    if (total >= kCopyWithoutGil) {
      Py_BEGIN_ALLOW_THREADS copy();
      Py_END_ALLOW_THREADS
    } else {
      copy();
    }
    *out = grpc::ByteBuffer(&slice, 1);
  }
  for (Py_buffer& v : views) PyBuffer_Release(&v);
  Py_DECREF(seq);
  return ok;
}

PyObject* CallWrite(CallObject* self, PyObject* pieces) {
  grpc::ByteBuffer message;
  if (!CopiedMessage(pieces, &message)) return nullptr;
  if ((*self->call)->stream == nullptr) {
    PyErr_SetString(PyExc_TypeError, "attnserve._native: write() on a unary call");
    return nullptr;
  }
  return PyBool_FromLong((*self->call)->Write(std::move(message)));
}

PyObject* CallWritesDone(CallObject* self, PyObject*) {
  if ((*self->call)->stream != nullptr) (*self->call)->WritesDone();
  Py_RETURN_NONE;
}

PyObject* CallCancel(CallObject* self, PyObject*) {
  (*self->call)->context.TryCancel();
  Py_RETURN_NONE;
}

PyMethodDef kCallMethods[] = {
    {"write", reinterpret_cast<PyCFunction>(CallWrite), METH_O,
     "write(pieces) -> bool: queues one message (copied now); False once the stream is over "
     "or writes_done() was called."},
    {"writes_done", reinterpret_cast<PyCFunction>(CallWritesDone), METH_NOARGS,
     "No more messages: sent after the queued ones."},
    {"cancel", reinterpret_cast<PyCFunction>(CallCancel), METH_NOARGS,
     "Cancels the call; on_done then gets CANCELLED (unless it had ended)."},
    {nullptr, nullptr, 0, nullptr}};

// A channel's C++ side; the Python object holds a pointer to it.
struct State {
  std::mutex mu;
  // Calls copy it under mu, so close() during a call is safe.
  std::shared_ptr<grpc::Channel> channel;
  std::shared_ptr<std::atomic<long long>> calls = std::make_shared<std::atomic<long long>>(0);
  Engine* engine = nullptr;  // the asynchronous calls', made by the first of them

  std::shared_ptr<grpc::Channel> Channel() {
    std::lock_guard<std::mutex> lock(mu);
    return channel;
  }

  // The engine, made now if need be; nullptr once closed.
  Engine* AsyncEngine() {
    std::lock_guard<std::mutex> lock(mu);
    if (engine == nullptr && channel) engine = new Engine(channel, calls);
    return engine;
  }

  // Takes the channel and the engine out (under mu); the caller closes them without the GIL.
  void TakeOut(std::shared_ptr<grpc::Channel>* ch, Engine** e) {
    std::lock_guard<std::mutex> lock(mu);
    ch->swap(channel);
    *e = engine;
    engine = nullptr;
  }
};

// Closes an engine taken out of a State (GIL released).
void CloseEngine(Engine* engine) {
  if (engine != nullptr && engine->Close()) delete engine;
}

struct ChannelObject {
  PyObject_HEAD State* state;
  PyObject* weakrefs;
};

int ChannelInit(ChannelObject* self, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"target", "options", nullptr};
  const char* target = nullptr;
  PyObject* options = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO", const_cast<char**>(kwlist), &target,
                                   &options)) {
    return -1;
  }
  grpc::ChannelArguments channel_args;
  PyObject* seq = PySequence_Fast(options, "options: expected a sequence of (name, value)");
  if (seq == nullptr) return -1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    const char* name = nullptr;
    PyObject* value = nullptr;
    if (!PyArg_ParseTuple(item, "sO", &name, &value)) {
      Py_DECREF(seq);
      return -1;
    }
    if (PyLong_Check(value)) {
      const long v = PyLong_AsLong(value);
      if ((v == -1 && PyErr_Occurred()) || v < INT_MIN || v > INT_MAX) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "options: %s: %R does not fit a C int", name, value);
        Py_DECREF(seq);
        return -1;
      }
      channel_args.SetInt(name, static_cast<int>(v));
    } else if (PyUnicode_Check(value)) {
      const char* text = PyUnicode_AsUTF8(value);
      if (text == nullptr) {
        Py_DECREF(seq);
        return -1;
      }
      channel_args.SetString(name, text);
    } else {
      PyErr_Format(PyExc_TypeError, "options: %s: expected an int or a str, got %s", name,
                   Py_TYPE(value)->tp_name);
      Py_DECREF(seq);
      return -1;
    }
  }
  Py_DECREF(seq);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), channel_args);
  std::lock_guard<std::mutex> lock(self->state->mu);
  self->state->channel = std::move(channel);
  return 0;
}

PyObject* ChannelNew(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<ChannelObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->state = new State;
  return reinterpret_cast<PyObject*>(self);
}

void ChannelDealloc(ChannelObject* self) {
  State* state = self->state;
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(reinterpret_cast<PyObject*>(self));
  std::shared_ptr<grpc::Channel> channel;
  Engine* engine = nullptr;
  state->TakeOut(&channel, &engine);
  // The channel's destructor may wait for gRPC's own threads, the engine for its calls.
  Py_BEGIN_ALLOW_THREADS CloseEngine(engine);
  channel.reset();
  delete state;
  Py_END_ALLOW_THREADS ReleaseLate();
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// Fills `context` with the deadline and metadata; false with a Python error set.
bool Prepare(PyObject* timeout, PyObject* metadata, grpc::ClientContext* context) {
  if (timeout != Py_None) {
    const double seconds = PyFloat_AsDouble(timeout);
    if (seconds == -1.0 && PyErr_Occurred()) return false;
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::duration_cast<std::chrono::system_clock::duration>(
                              std::chrono::duration<double>(seconds)));
  }
  if (metadata == Py_None) return true;
  PyObject* seq = PySequence_Fast(metadata, "metadata: expected a sequence of (key, value)");
  if (seq == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* key = nullptr;
    const char* value = nullptr;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ss", &key, &value)) {
      Py_DECREF(seq);
      return false;
    }
    context->AddMetadata(key, value);
  }
  Py_DECREF(seq);
  return true;
}

// The request's pieces as slices over the caller's buffers, held by `held`.
bool SlicesOf(PyObject* pieces, HeldBuffers* held, std::vector<grpc::Slice>* slices) {
  PyObject* seq = PySequence_Fast(pieces, "pieces: expected a sequence of buffers");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  held->views.reserve(n);
  slices->reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_buffer view;
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_C_CONTIGUOUS) != 0) {
      Py_DECREF(seq);
      return false;
    }
    if (view.len == 0) {
      PyBuffer_Release(&view);
      continue;
    }
    held->views.push_back(view);
    held->refs.fetch_add(1, std::memory_order_relaxed);
    // gRPC only reads these bytes (it sends them).
    slices->emplace_back(view.buf, static_cast<size_t>(view.len), &HeldBuffers::Unref, held);
  }
  Py_DECREF(seq);
  return true;
}

PyObject* ChannelUnary(ChannelObject* self, PyObject* args) {
  const char* path = nullptr;
  PyObject* pieces = nullptr;
  PyObject* timeout = Py_None;
  PyObject* metadata = Py_None;
  if (!PyArg_ParseTuple(args, "sO|OO", &path, &pieces, &timeout, &metadata)) return nullptr;
  ReleaseLate();
  std::shared_ptr<grpc::Channel> channel = self->state->Channel();
  if (!channel) {
    PyErr_SetString(PyExc_ValueError, "attnserve._native: the channel is closed");
    return nullptr;
  }
  // The call's queue, made once the call is sure to be made (a queue must be
  // shut down and drained before it goes); declared before the context, so the
  // call (which the context owns) goes first.
  std::optional<grpc::CompletionQueue> cq;
  grpc::ClientContext context;
  if (!Prepare(timeout, metadata, &context)) return nullptr;
  const std::string method(path);

  auto* held = new HeldBuffers;
  std::vector<grpc::Slice> slices;
  if (!SlicesOf(pieces, held, &slices)) {
    slices.clear();  // their destroy functions drop their references
    held->UnrefHoldingGil();
    return nullptr;
  }
  grpc::ByteBuffer response;
  grpc::Status status;
  std::vector<grpc::Slice> parts;
  Py_BEGIN_ALLOW_THREADS {
    cq.emplace();
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call;
    {
      // The call takes its own references to the slices: `request` may go now.
      grpc::ByteBuffer request(slices.data(), slices.size());
      slices.clear();
      call = grpc::GenericStub(channel).PrepareUnaryCall(&context, method, request, &*cq);
    }
    void* tag = nullptr;
    bool ok = false;
    if (call == nullptr) {
      status = grpc::Status(grpc::StatusCode::INTERNAL, "attnserve._native: no call was made");
    } else {
      call->StartCall();
      call->Finish(&response, &status, &call);
      if (!cq->Next(&tag, &ok) || tag != &call) {
        status = grpc::Status(grpc::StatusCode::INTERNAL,
                              "attnserve._native: the call's completion queue failed");
      }
    }
    call.reset();
    cq->Shutdown();
    while (cq->Next(&tag, &ok)) {
    }
  }
  if (status.ok()) status = response.Dump(&parts);
  Py_END_ALLOW_THREADS held->UnrefHoldingGil();
  self->state->calls->fetch_add(1, std::memory_order_relaxed);
  if (!status.ok()) {
    const std::string& message = status.error_message();
    return Py_BuildValue(
        "(iN)", static_cast<int>(status.error_code()),
        PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "replace"));
  }
  size_t total = 0;
  for (const grpc::Slice& s : parts) total += s.size();
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (out == nullptr) return nullptr;
  // Nothing else holds `out` yet: it is filled without the GIL.
  char* at = PyBytes_AS_STRING(out);
  Py_BEGIN_ALLOW_THREADS for (const grpc::Slice& s : parts) {
    std::memcpy(at, s.begin(), s.size());
    at += s.size();
  }
  parts.clear();
  Py_END_ALLOW_THREADS return Py_BuildValue("(iN)", 0, out);
}

PyObject* ChannelClose(ChannelObject* self, PyObject*) {
  std::shared_ptr<grpc::Channel> channel;
  Engine* engine = nullptr;
  self->state->TakeOut(&channel, &engine);
  Py_BEGIN_ALLOW_THREADS CloseEngine(engine);
  channel.reset();
  Py_END_ALLOW_THREADS ReleaseLate();
  Py_RETURN_NONE;
}

// A new asynchronous call on the channel's engine, its deadline and metadata
// set and its callbacks taken; nullptr with a Python error set.
std::shared_ptr<AsyncCall> NewCall(ChannelObject* self, PyObject* timeout, PyObject* metadata,
                                   PyObject* on_read, PyObject* on_done) {
  if (!PyCallable_Check(on_done) || (on_read != nullptr && !PyCallable_Check(on_read))) {
    PyErr_SetString(PyExc_TypeError, "attnserve._native: on_read and on_done must be callable");
    return nullptr;
  }
  Engine* engine = self->state->AsyncEngine();
  if (engine == nullptr) {
    PyErr_SetString(PyExc_ValueError, "attnserve._native: the channel is closed");
    return nullptr;
  }
  auto call = std::make_shared<AsyncCall>(engine);
  if (!Prepare(timeout, metadata, &call->context)) return nullptr;
  Py_XINCREF(on_read);
  Py_INCREF(on_done);
  call->on_read = on_read;
  call->on_done = on_done;
  if (!engine->Add(call)) {
    Py_CLEAR(call->on_read);
    Py_CLEAR(call->on_done);
    PyErr_SetString(PyExc_ValueError, "attnserve._native: the channel is closed");
    return nullptr;
  }
  return call;
}

PyObject* CallObjectOf(std::shared_ptr<AsyncCall> call) {
  auto* obj = PyObject_New(CallObject, &kCallType);
  if (obj == nullptr) {
    call->context.TryCancel();  // nothing could cancel it later
    return nullptr;
  }
  obj->call = new std::shared_ptr<AsyncCall>(std::move(call));
  return reinterpret_cast<PyObject*>(obj);
}

PyObject* ChannelStartUnary(ChannelObject* self, PyObject* args) {
  const char* path = nullptr;
  PyObject *pieces = nullptr, *timeout = nullptr, *metadata = nullptr, *on_done = nullptr;
  if (!PyArg_ParseTuple(args, "sOOOO", &path, &pieces, &timeout, &metadata, &on_done)) {
    return nullptr;
  }
  ReleaseLate();
  auto* held = new HeldBuffers;
  std::vector<grpc::Slice> slices;
  if (!SlicesOf(pieces, held, &slices)) {
    slices.clear();
    held->UnrefHoldingGil();
    return nullptr;
  }
  std::shared_ptr<AsyncCall> call = NewCall(self, timeout, metadata, nullptr, on_done);
  if (call == nullptr) {
    slices.clear();
    held->UnrefHoldingGil();
    return nullptr;
  }
  {
    grpc::ByteBuffer request(slices.data(), slices.size());
    slices.clear();
    std::lock_guard<std::mutex> lock(call->mu);
    call->unary = grpc::GenericStub(call->engine->channel())
                      .PrepareUnaryCall(&call->context, path, request, call->engine->cq());
    call->unary->StartCall();
    call->started = call->finishing = true;
    call->outstanding = 1;
    call->unary->Finish(&call->incoming, &call->status, &call->finish);
  }
  held->UnrefHoldingGil();  // the call holds its own references to the slices
  return CallObjectOf(std::move(call));
}

PyObject* ChannelStartStream(ChannelObject* self, PyObject* args) {
  const char* path = nullptr;
  PyObject *timeout = nullptr, *metadata = nullptr, *on_read = nullptr, *on_done = nullptr;
  if (!PyArg_ParseTuple(args, "sOOOO", &path, &timeout, &metadata, &on_read, &on_done)) {
    return nullptr;
  }
  ReleaseLate();
  std::shared_ptr<AsyncCall> call = NewCall(self, timeout, metadata, on_read, on_done);
  if (call == nullptr) return nullptr;
  {
    std::lock_guard<std::mutex> lock(call->mu);
    call->stream = grpc::GenericStub(call->engine->channel())
                       .PrepareCall(&call->context, path, call->engine->cq());
    call->outstanding = 1;
    call->stream->StartCall(&call->start);
  }
  return CallObjectOf(std::move(call));
}

PyObject* ChannelCalls(ChannelObject* self, void*) {
  return PyLong_FromLongLong(self->state->calls->load(std::memory_order_relaxed));
}

PyMethodDef kChannelMethods[] = {
    {"unary", reinterpret_cast<PyCFunction>(ChannelUnary), METH_VARARGS,
     "unary(path, pieces, timeout=None, metadata=None) -> (code, bytes | message)"},
    {"start_unary", reinterpret_cast<PyCFunction>(ChannelStartUnary), METH_VARARGS,
     "start_unary(path, pieces, timeout, metadata, on_done) -> Call; "
     "on_done(code, bytes | message) on the completion thread"},
    {"start_stream", reinterpret_cast<PyCFunction>(ChannelStartStream), METH_VARARGS,
     "start_stream(path, timeout, metadata, on_read, on_done) -> Call; on_read(bytes) per "
     "response, then on_done(code, message)"},
    {"close", reinterpret_cast<PyCFunction>(ChannelClose), METH_NOARGS,
     "Closes the channel: blocking calls in flight finish on their own reference, "
     "asynchronous ones are cancelled and waited for."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kChannelGetSet[] = {{"calls", reinterpret_cast<getter>(ChannelCalls), nullptr,
                                 "Calls completed on this channel (succeeded or not).", nullptr},
                                {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject kChannelType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "attnserve._native",
    "Tensor-carrying calls (unary and streams) through gRPC C++ (see _native.cc).", -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native() {
  kChannelType.tp_name = "attnserve._native.Channel";
  kChannelType.tp_basicsize = sizeof(ChannelObject);
  kChannelType.tp_flags = Py_TPFLAGS_DEFAULT;
  kChannelType.tp_doc = "A plain-text gRPC C++ channel for attnserve._wire's requests.";
  kChannelType.tp_new = ChannelNew;
  kChannelType.tp_init = reinterpret_cast<initproc>(ChannelInit);
  kChannelType.tp_dealloc = reinterpret_cast<destructor>(ChannelDealloc);
  kChannelType.tp_methods = kChannelMethods;
  kChannelType.tp_getset = kChannelGetSet;
  kChannelType.tp_weaklistoffset = offsetof(ChannelObject, weakrefs);
  if (PyType_Ready(&kChannelType) < 0) return nullptr;
  kCallType.tp_name = "attnserve._native.Call";
  kCallType.tp_basicsize = sizeof(CallObject);
  kCallType.tp_flags = Py_TPFLAGS_DEFAULT;
  kCallType.tp_doc = "An asynchronous call of a Channel (start_unary, start_stream).";
  kCallType.tp_dealloc = reinterpret_cast<destructor>(CallDealloc);
  kCallType.tp_methods = kCallMethods;
  if (PyType_Ready(&kCallType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  Py_INCREF(&kChannelType);
  if (PyModule_AddObject(module, "Channel", reinterpret_cast<PyObject*>(&kChannelType)) < 0) {
    Py_DECREF(&kChannelType);
    Py_DECREF(module);
    return nullptr;
  }
  PyModule_AddStringConstant(module, "GRPC_VERSION", grpc::Version().c_str());
  return module;
}
