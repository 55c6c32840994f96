# Checks that proto/inference/*.proto, written here, matches the KServe v2 /
# Triton wire format: every message, field (name, number, type, label) and
# service method we declare must exist identically in the descriptors that the
# pinned tritonclient wheel was generated from. Run by ctest as
# kserve_proto_wire (tests/kserve/CMakeLists.txt) with --protoc and --proto_dir.
import argparse
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2


def theirs():
    messages, services = {}, {}
    for module in (model_config_pb2, service_pb2):
        fd = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(fd)
        collect(fd, messages, services)
    return messages, services


def collect(fd, messages, services):
    def walk(prefix, msg):
        name = f"{prefix}.{msg.name}"
        messages[name] = {f.name: (f.number, f.type, f.label, f.type_name.split(".")[-1])
                          for f in msg.field}
        for nested in msg.nested_type:
            if not nested.options.map_entry:
                walk(name, nested)
    for msg in fd.message_type:
        walk(fd.package, msg)
    for enum in fd.enum_type:
        messages[f"{fd.package}.{enum.name}"] = {v.name: (v.number,) for v in enum.value}
    for svc in fd.service:
        services[f"{fd.package}.{svc.name}"] = {
            m.name: (m.input_type.split(".")[-1], m.output_type.split(".")[-1],
                     m.client_streaming, m.server_streaming) for m in svc.method}


def ours(protoc, proto_dir):
    with tempfile.NamedTemporaryFile(suffix=".pb") as out:
        subprocess.run([protoc, f"--proto_path={proto_dir}", f"--descriptor_set_out={out.name}",
                        "inference/grpc_service.proto", "inference/model_config.proto"], check=True)
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(open(out.name, "rb").read())
    messages, services = {}, {}
    for fd in fds.file:
        assert fd.package == "inference", fd.package
        collect(fd, messages, services)
    return messages, services


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--protoc", required=True)
    parser.add_argument("--proto_dir", required=True)
    args = parser.parse_args()
    their_messages, their_services = theirs()
    our_messages, our_services = ours(args.protoc, args.proto_dir)
    errors = []
    for name, fields in our_messages.items():
        if name not in their_messages:
            errors.append(f"{name}: not in tritonclient's protocol")
            continue
        for field, spec in fields.items():
            if their_messages[name].get(field) != spec:
                errors.append(f"{name}.{field}: ours {spec}, tritonclient's "
                              f"{their_messages[name].get(field)}")
    for name, methods in our_services.items():
        for method, spec in methods.items():
            if their_services.get(name, {}).get(method) != spec:
                errors.append(f"{name}/{method}: ours {spec}, tritonclient's "
                              f"{their_services.get(name, {}).get(method)}")
    checked = sum(len(f) for f in our_messages.values())
    for e in errors:
        print("MISMATCH", e)
    print(f"{len(our_messages)} messages/enums, {checked} fields, "
          f"{sum(len(m) for m in our_services.values())} methods checked; {len(errors)} mismatches")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
