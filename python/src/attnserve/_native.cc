// attnserve._native: the tensor-carrying unary calls through gRPC C++ instead of grpcio.
//
// Why (bench/NOTES-python.md): grpcio takes a request only as one
// `bytes` and copies it into its own buffer, and hands a response over after
// copying it three times (a `bytes` per received slice, a bytearray, then
// `bytes` of that), all fresh allocations that a loaded machine faults in
// page by page. Here a request goes out as gRPC slices that reference the
// caller's buffers (attnserve._wire's pieces: the small message, each
// tensor's header and the tensor's own memory: no copy), and a response
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
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
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

// A channel's C++ side; the Python object holds a pointer to it.
struct State {
  std::mutex mu;
  // Calls copy it under mu, so close() during a call is safe.
  std::shared_ptr<grpc::Channel> channel;
  std::atomic<long long> calls{0};

  std::shared_ptr<grpc::Channel> Channel() {
    std::lock_guard<std::mutex> lock(mu);
    return channel;
  }
};

struct ChannelObject {
  PyObject_HEAD State* state;
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
  Py_BEGIN_ALLOW_THREADS delete state;  // the channel's destructor may wait for gRPC's own threads
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
  self->state->calls.fetch_add(1, std::memory_order_relaxed);
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
  {
    std::lock_guard<std::mutex> lock(self->state->mu);
    channel.swap(self->state->channel);
  }
  Py_BEGIN_ALLOW_THREADS channel.reset();
  Py_END_ALLOW_THREADS ReleaseLate();
  Py_RETURN_NONE;
}

PyObject* ChannelCalls(ChannelObject* self, void*) {
  return PyLong_FromLongLong(self->state->calls.load(std::memory_order_relaxed));
}

PyMethodDef kChannelMethods[] = {
    {"unary", reinterpret_cast<PyCFunction>(ChannelUnary), METH_VARARGS,
     "unary(path, pieces, timeout=None, metadata=None) -> (code, bytes | message)"},
    {"close", reinterpret_cast<PyCFunction>(ChannelClose), METH_NOARGS,
     "Closes the channel (calls in flight finish on their own reference)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kChannelGetSet[] = {{"calls", reinterpret_cast<getter>(ChannelCalls), nullptr,
                                 "Calls completed on this channel (succeeded or not).", nullptr},
                                {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject kChannelType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "attnserve._native",
                       "Tensor-carrying unary calls through gRPC C++ (see _native.cc).", -1,
                       nullptr};

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
  if (PyType_Ready(&kChannelType) < 0) return nullptr;
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
