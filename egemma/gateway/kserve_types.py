"""The JSON types of a KServe v2 infer request as Triton 2.51 reads them: it answers a field or a `data` element of
another type with a 500 ("attempt to access JSON non-string as string"), a lone surrogate escape anywhere in the
JSON too, wraps an integer past its datatype's range (2^40 in INT32 data becomes a valid token id) and cuts a string
parameter at its first NUL (its C API). The gateway's gate (egemma.gateway.admission) refuses each first, naming
the field."""
from __future__ import annotations

import math
import re

from egemma.gateway.errors import GatewayError, Kind

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate escape: checked to be half of a pair (rare: decoded)
# The JSON type of each field Triton reads (it answers a 500 for another); a tensor's parameters' too.
_REQUEST = {"id": str, "parameters": dict, "inputs": list, "outputs": list}
_TENSOR = {"name": str, "datatype": str, "shape": list, "parameters": dict, "data": list}
_TENSOR_PARAMS = {"binary_data_size": int, "binary_data": bool, "shared_memory_region": str,
                  "shared_memory_offset": int, "shared_memory_byte_size": int, "classification": int}
_JSON = {dict: "object", list: "array", str: "string", int: "integer", bool: "boolean"}
_BITS = {f"{u}INT{b}": b for u in ("", "U") for b in (8, 16, 32, 64)}


def _fields(obj, types: dict, where: str):
    if not isinstance(obj, dict):
        raise GatewayError(Kind.VALIDATION, f"{where} must be a JSON object", where)
    for k, t in types.items():
        if k in obj and type(obj[k]) is not t:
            raise GatewayError(Kind.VALIDATION, f"{where}.{k} must be a JSON {_JSON[t]}", f"{where}.{k}")


def _leaves(data: list) -> list:
    while any(type(x) is list for x in data):
        data = [y for x in data for y in (x if type(x) is list else (x,))]
    return data


def _check_data(i: dict, where: str):
    """The elements of an input's JSON data, of its datatype's JSON type: strings (BYTES), booleans (BOOL),
    numbers (FP*), integers in range (INT*, UINT*)."""
    leaves, dt, shape = _leaves(i["data"]), i.get("datatype"), i.get("shape")
    if isinstance(shape, list) and len(leaves) != math.prod(shape):
        raise GatewayError(Kind.VALIDATION, f"{where}.data holds {len(leaves)} elements, its shape {shape} "
                                            f"{math.prod(shape)}", f"{where}.data")
    types = set(map(type, leaves))
    if dt == "BYTES":
        ok, what = types <= {str}, "strings"
    elif dt == "BOOL":
        ok, what = types <= {bool}, "true / false"
    elif isinstance(dt, str) and dt.startswith("FP"):
        ok, what = types <= {int, float}, "numbers"
    elif dt in _BITS:  # in the type's range: Triton would wrap 2^40 in INT32 data to 0, a valid token id
        lo, hi = (0, 1 << _BITS[dt]) if dt[0] == "U" else (-(1 << _BITS[dt] - 1), 1 << _BITS[dt] - 1)
        ok = types <= {int} and (not leaves or lo <= min(leaves) and max(leaves) < hi)
        what = f"integers in [{lo}, {hi})"
    else:
        return  # Triton names the datatype it does not know
    if not ok:
        raise GatewayError(Kind.VALIDATION, f"{where}.data must hold only {what} for datatype {dt}", f"{where}.data")


def check_request(req):
    """A KServe infer request's fields and data of the JSON types Triton reads, and no string parameter with NUL."""
    _fields(req, _REQUEST, "request")
    for k, v in (req.get("parameters") or {}).items():
        if isinstance(v, str) and "\0" in v:
            raise GatewayError(Kind.VALIDATION, f"parameter {k} must not contain NUL (it would be cut there)", k)
    for kind in ("inputs", "outputs"):
        for j, t in enumerate(req.get(kind) or ()):
            where = f"{kind}[{j}]"
            _fields(t, _TENSOR, where)
            _fields(t.get("parameters", {}), _TENSOR_PARAMS, f"{where}.parameters")
            if "shape" in t and not all(type(d) is int for d in t["shape"]):
                raise GatewayError(Kind.VALIDATION, f"{where}.shape must hold only integers", f"{where}.shape")
            if kind == "inputs" and "data" in t:
                _check_data(t, where)


def lone_surrogate(obj) -> bool:
    """Whether any string of the decoded JSON, a key too, holds half of a surrogate pair (not UTF-8 encodable)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(o, dict):
            stack += [*o.keys(), *o.values()]
        elif isinstance(o, list):
            stack += o
    return False
