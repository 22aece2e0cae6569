"""The client over a TLS listener (wprepd terminates TLS itself), with certificates made
here by openssl: every reference case converts through it, a 16 MiB answer comes back
(the client's message-size options apply to TLS channels too), and mutual TLS refuses a
client without a certificate."""

import os
import shutil
import subprocess
import tempfile

import grpc
import pytest

import golden
from conftest import wprepd_path
from wprep import Client, Spec, WprepError
from wprep.testing import LocalDaemon

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def _run(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def certs():
    d = tempfile.mkdtemp(prefix="wprep-py-tls-")
    p = lambda name: os.path.join(d, name)  # noqa: E731
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=wprep-py-ca",
         "-keyout", p("ca.key"), "-out", p("ca.pem"))
    for who, subject, ext in [("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1"),
                              ("client", "/CN=wprep-py-client", "extendedKeyUsage=clientAuth")]:
        with open(p(who + ".ext"), "w") as f:
            f.write(ext + "\n")
        _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", p(who + ".key"),
             "-out", p(who + ".csr"))
        _run("openssl", "x509", "-req", "-in", p(who + ".csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
             "-CAcreateserial", "-days", "2", "-extfile", p(who + ".ext"), "-out", p(who + ".pem"))
    files = {}
    for name in ["ca.pem", "server.pem", "server.key", "client.pem", "client.key"]:
        with open(p(name), "rb") as f:
            files[name] = f.read()
    files["dir"] = d
    yield files
    shutil.rmtree(d, ignore_errors=True)


def _tls_daemon(certs, *extra):
    d = certs["dir"]
    return LocalDaemon(wprepd_path(), ["--devices=cpu", "--cpu-threads=2", "--listen=127.0.0.1:0",
                                       f"--tls-cert={d}/server.pem", f"--tls-key={d}/server.key", *extra])


def test_reference_cases_and_a_16_mib_answer_over_tls(certs):
    with _tls_daemon(certs) as daemon:
        (target,) = daemon.tcp_targets
        creds = grpc.ssl_channel_credentials(root_certificates=certs["ca.pem"])
        with Client(target, credentials=creds, timeout=60) as c:
            cases = [x for x in golden.all_cases() if not x.error]
            for case in cases:
                r = c.convert(case.spec, case.logical_shape, golden.golden_input(case),
                              strides=case.input_strides or None)
                assert golden.matches(case, r.data), case.name
            # 16 MiB each way: above gRPC's 4 MiB default receive limit.
            r = c.convert(Spec("hopper_value", mx_axis=-2), [4096, 8192], bytes(16 << 20))
            assert r.nbytes == 16 << 20
            assert r.data == bytes(16 << 20)
        with Client(target, timeout=10) as plain:
            with pytest.raises(WprepError):
                plain.devices()


def test_mutual_tls_needs_a_client_certificate_of_the_ca(certs):
    with _tls_daemon(certs, f"--tls-client-ca={certs['dir']}/ca.pem") as daemon:
        (target,) = daemon.tcp_targets
        anonymous = grpc.ssl_channel_credentials(root_certificates=certs["ca.pem"])
        with Client(target, credentials=anonymous, timeout=10) as c:
            with pytest.raises(WprepError):
                c.devices()
        mutual = grpc.ssl_channel_credentials(root_certificates=certs["ca.pem"], private_key=certs["client.key"],
                                              certificate_chain=certs["client.pem"])
        with Client(target, credentials=mutual, timeout=10) as c:
            assert c.devices() is not None
