"""Safe defaults of the shared real tritonserver: the model-repository, shared-memory, trace and logging APIs answer
only with the admin key, over HTTP and gRPC, while inference, health, metadata and statistics stay open. (The
launcher's loopback-only sockets and its admin key: tests/test_lifecycle.py.)"""
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.usefixtures("still_serving")


def test_admin_apis_need_the_admin_key(server):
    key = {"admin-key": server.admin_key}
    base = f"http://{server.http_url}/v2"
    calls = [("post", "/repository/index"), ("get", "/trace/setting"), ("get", "/logging"),
             ("get", "/systemsharedmemory/status"), ("get", "/cudasharedmemory/status")]
    for method, path in calls:
        refused = requests.request(method, base + path, timeout=10)
        wrong = requests.request(method, base + path, headers={"admin-key": "wrong"}, timeout=10)
        allowed = requests.request(method, base + path, headers=key, timeout=10)
        assert refused.status_code == 403 and "restricted" in refused.json()["error"], (path, refused.text)
        assert wrong.status_code == 403, (path, wrong.text)
        assert allowed.status_code == 200, (path, allowed.text)
    # Settings can't be changed without the key either.
    assert requests.post(base + "/logging", json={"log_verbose_level": 1}, timeout=10).status_code == 403
    # Inference, health, metadata and statistics stay open.
    for path in ("/health/ready", "/models/embeddinggemma", "/models/embeddinggemma/stats"):
        assert requests.get(base + path, timeout=10).status_code == 200, path
    # gRPC: Triton prefixes the key of --grpc-restricted-protocol with "triton-grpc-protocol-".
    c = grpcclient.InferenceServerClient(server.grpc_url)
    for call in (c.get_model_repository_index, c.get_trace_settings, c.get_log_settings,
                 c.get_system_shared_memory_status):
        with pytest.raises(InferenceServerException, match="restricted"):
            call()
        with pytest.raises(InferenceServerException, match="restricted"):
            call(headers=key)
        call(headers={"triton-grpc-protocol-admin-key": server.admin_key})
