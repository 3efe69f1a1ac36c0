"""schemathesis hooks of scripts/api-fuzz.sh (loaded through SCHEMATHESIS_HOOKS).

Steering: a purely random body names files and devices that do not exist,
so nearly every request stops at "cannot open" or "no such device". In the
fuzzing phase, positive (schema-valid) bodies get some of their strings and
numbers drawn from values that exist in the round's directory (the VMM's
cwd, prepared by the script): the files vmlinux (a halting PVH kernel),
disk0.pcow, disk1.pcow, raw0.img; the devices pmem0, pmem1, raw0; the
snapshot tag "before". The draw keeps the generated value as one choice, so
the random cases stay too. Paths the VMM would create (overlay, serial and
console files) are kept inside that directory in every phase and mode: no
"/" in them (schemathesis also reuses strings from earlier responses, such
as absolute paths).

Two checks of properties across requests:
- `accepted_vm_config_boots`: a config `vm.create` accepted (204) boots or
  is refused with a 4xx; the check boots it, then deletes the VM (each 5xx
  a failure), so that the next generated config can be created;
- `snapshot_can_be_restored`: a snapshot `vm.pmem-snapshot` just took (200)
  can be rolled back to (with `reset`, so on a running VM too) and deleted,
  each answering 200.
"""

import copy
import os

import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode

FILES = ["vmlinux", "disk0.pcow", "disk1.pcow", "raw0.img"]
DEVICES = ["pmem0", "pmem1", "raw0"]
MIB = 1 << 20


def put(url, body=None):
    """A request of a check, counted in $API_FUZZ_EXTRA_LOG (one line each)."""
    r = requests.put(url, json=body, timeout=60)
    log = os.environ.get("API_FUZZ_EXTRA_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"PUT {url} {r.status_code}\n")
    return r


def one_of(values, current):
    return st.sampled_from([*values, current])


def local(path):
    """A path the VMM may create: relative, one component, in its cwd."""
    return path.replace("/", "_") if isinstance(path, str) else path


@st.composite
def vm_config(draw, body):
    body = copy.deepcopy(body)
    payload = body.get("payload")
    if not isinstance(payload, dict) and draw(st.booleans()):
        payload = body["payload"] = {}
    if isinstance(payload, dict):
        payload["kernel"] = draw(one_of(["vmlinux", "vmlinux", "raw0.img"], payload.get("kernel")))
        if isinstance(payload.get("initramfs"), str):
            payload["initramfs"] = draw(one_of(FILES, payload["initramfs"]))
    cpus = body.get("cpus")
    if isinstance(cpus, dict) and isinstance(cpus.get("boot_vcpus"), int):
        cpus["boot_vcpus"] = draw(one_of([1, 2], cpus["boot_vcpus"]))
        if draw(st.booleans()):
            cpus["max_vcpus"] = cpus["boot_vcpus"]
    memory = body.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("size"), int):
        memory["size"] = draw(one_of([64 * MIB, 2 * MIB, 4096, 1 << 30], memory["size"]))
    for dev in body.get("pmem") or []:
        if isinstance(dev, dict) and isinstance(dev.get("file"), str):
            dev["file"] = draw(one_of(FILES, dev["file"]))
    for name in ("serial", "console"):
        port = body.get(name)
        if isinstance(port, dict) and "file" in port:
            port["file"] = local(port["file"])
    return body


@st.composite
def pmem_config(draw, body):
    body = copy.deepcopy(body)
    if isinstance(body.get("file"), str):
        body["file"] = draw(one_of(FILES, body["file"]))
    if "id" in body:
        body["id"] = draw(one_of(["pmem1", "pmem2", None], body["id"]))
    return body


@st.composite
def pmem_action(draw, body):
    body = copy.deepcopy(body)
    if isinstance(body.get("id"), str):
        # Overlays on one device: its chain grows to the depth limit.
        devices = ["pmem0"] if isinstance(body.get("file"), str) else DEVICES
        body["id"] = draw(one_of(devices, body["id"]))
    for key in ("tag", "snapshot"):
        if isinstance(body.get(key), str):
            body[key] = draw(one_of(["before", "after", "1"], body[key]))
    if isinstance(body.get("file"), str):
        # The generated name first (Hypothesis favours the first choice):
        # most overlays succeed, and the chain grows.
        body["file"] = draw(st.sampled_from([local(body["file"]), "overlay.pcow"]))
    if "snapshot" in body:
        body["reset"] = draw(one_of([True, False], body.get("reset", False)))
    return body


@st.composite
def remove_device(draw, body):
    body = copy.deepcopy(body)
    if isinstance(body.get("id"), str):
        # Not pmem0: the pmem-* actions that run after it need it.
        body["id"] = draw(one_of(["pmem1", "raw0"], body["id"]))
    return body


STEERS = {
    "PUT /vm.create": vm_config,
    "PUT /vm.add-pmem": pmem_config,
    "PUT /vm.remove-device": remove_device,
    "PUT /vm.pmem-snapshot": pmem_action,
    "PUT /vm.pmem-overlay": pmem_action,
    "PUT /vm.pmem-rollback": pmem_action,
    "PUT /vm.pmem-snapshot-delete": pmem_action,
    "PUT /vm.pmem-flush": pmem_action,
}


def with_body(case, body):
    case.body = body
    return case


def sanitized(body):
    """`body` with the paths the VMM would create made local."""
    body = copy.deepcopy(body)
    targets = [body]
    targets += [body.get(k) for k in ("serial", "console")]
    for t in targets:
        if isinstance(t, dict) and isinstance(t.get("file"), str):
            t["file"] = local(t["file"])
    return body


@schemathesis.hook
def map_case(ctx, case):
    if ctx.operation.label in ("PUT /vm.create", "PUT /vm.pmem-overlay") and isinstance(
        case.body, dict
    ):
        case.body = sanitized(case.body)
    return case


@schemathesis.hook
def flatmap_case(ctx, case):
    steer = STEERS.get(ctx.operation.label)
    meta = case.meta
    positive = meta is not None and meta.generation.mode == GenerationMode.POSITIVE
    if steer is None or not positive or not isinstance(case.body, dict):
        return st.just(case)
    return steer(case.body).map(lambda body: with_body(case, body))


@schemathesis.check
def accepted_vm_config_boots(ctx, response, case):
    """A config vm.create accepted boots, or vm.boot refuses it with a 4xx."""
    if case.operation.label != "PUT /vm.create" or response.status_code != 204:
        return None
    base = response.request.url.rsplit("/", 1)[0]
    boot = put(f"{base}/vm.boot")
    delete = put(f"{base}/vm.delete")
    if boot.status_code >= 500:
        raise AssertionError(
            f"vm.boot of a config vm.create accepted answered {boot.status_code}: {boot.text}"
        )
    if delete.status_code != 204:
        raise AssertionError(f"vm.delete answered {delete.status_code}: {delete.text}")
    return None


@schemathesis.check
def snapshot_can_be_restored(ctx, response, case):
    """A snapshot just taken can be rolled back to, then deleted."""
    if case.operation.label != "PUT /vm.pmem-snapshot" or response.status_code != 200:
        return None
    base = response.request.url.rsplit("/", 1)[0]
    snap = response.json()
    ref = {"id": snap["id"], "snapshot": str(snap["snapshot"]["id"])}
    rollback = put(f"{base}/vm.pmem-rollback", {**ref, "reset": True})
    delete = put(f"{base}/vm.pmem-snapshot-delete", ref)
    for what, r in (("vm.pmem-rollback", rollback), ("vm.pmem-snapshot-delete", delete)):
        if r.status_code != 200:
            raise AssertionError(f"{what} {ref} answered {r.status_code}: {r.text}")
    return None
