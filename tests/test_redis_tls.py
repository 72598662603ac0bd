"""Redis over TLS from the clients' side (issue 45): a rediss:// URL naming the CA reaches a
TLS-only redis-server, records go through, and without the CA the certificate is refused."""

import shutil
import subprocess
import time

import pytest
import redis

from infra.config import StreamConfig
from infra.redis.server import find_redis_server, free_port
from infra.records.streams import RecordConsumer, RecordProducer, connect
from test_records_v2 import make_record

pytestmark = pytest.mark.redis


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_server(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=osd-test-ca", cwd=tmp_path)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj",
             "/CN=localhost", cwd=tmp_path)
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "tls.crt", "-days", "1", "-extfile", "ext", cwd=tmp_path)
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", "0", "--tls-port", str(port), "--tls-cert-file", "tls.crt",
                             "--tls-key-file", "tls.key", "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no",
                             "--save", "", "--dir", str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.crt'}"
    try:
        for _ in range(50):
            if proc.poll() is not None:
                pytest.skip(f"this redis-server has no TLS: {proc.stdout.read().decode()[-300:]}")
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        yield url, port
    finally:
        proc.terminate()
        proc.wait(10)


def test_records_travel_over_tls_and_an_unverified_server_is_refused(tls_server):
    url, port = tls_server
    cfg = StreamConfig(stream="osd:tls", block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5)
    with RecordProducer(url, cfg) as producer:
        assert producer.submit(make_record(1, tenant="acme")) and producer.flush(5)
    got = RecordConsumer(url, cfg, name="t").read(count=5)
    assert [d.record.tenant for d in got] == ["acme"]
    with pytest.raises(redis.ConnectionError):
        connect(f"rediss://127.0.0.1:{port}/0", cfg).ping()  # no CA: the self-signed chain fails
