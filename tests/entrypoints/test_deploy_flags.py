"""The deployment flags of `serve`: TLS (`--ssl-keyfile`/`--ssl-certfile`, startup errors for
half a pair or bad files) and CORS (`--allowed-origins` & co.: preflights answered without
the API key, allowed and refused origins, JSON-list parsing), on real servers.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, launch_server
from tests.tiny_models import tiny_model_dir
from vllm_mamba.entrypoints.cli import build_parser
from vllm_mamba.entrypoints.openai.api_server import tls_options

GOOD_ORIGIN = "http://good.example"
BAD_ORIGIN = "http://evil.example"


def make_self_signed(directory: Path) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1 and localhost (PEM files)."""
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:  # no `cryptography`: the openssl command line
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
            + ["-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key_path)]
            + ["-out", str(cert_path), "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
            check=True,
            capture_output=True,
        )
        return str(key_path), str(cert_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def serve_args(*flags: str):  # noqa: ANN201 - an argparse.Namespace
    return build_parser().parse_args(["serve", "some-model", *flags])


# --- flag parsing and TLS checks (no server) ---


def test_tls_needs_both_files(tmp_path: Path) -> None:
    key, cert = make_self_signed(tmp_path)
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        tls_options(serve_args("--ssl-keyfile", key))
    with pytest.raises(ValueError, match="--ssl-certfile needs --ssl-keyfile"):
        tls_options(serve_args("--ssl-certfile", cert))
    with pytest.raises(ValueError, match="need --ssl-keyfile"):
        tls_options(serve_args("--ssl-cert-reqs", "2"))
    with pytest.raises(ValueError, match="cannot load"):
        tls_options(serve_args("--ssl-keyfile", cert, "--ssl-certfile", cert))
    with pytest.raises(ValueError, match="cannot load"):
        tls_options(serve_args("--ssl-keyfile", key, "--ssl-certfile", str(tmp_path / "none")))
    assert tls_options(serve_args()) == {}
    options = tls_options(serve_args("--ssl-keyfile", key, "--ssl-certfile", cert))
    assert options["ssl_keyfile"] == key and options["ssl_certfile"] == cert
    assert options["ssl_cert_reqs"] == ssl.CERT_NONE


def test_cors_flags_parse_json_lists(capsys: pytest.CaptureFixture[str]) -> None:
    args = serve_args()
    assert args.allowed_origins == ["*"] and args.allowed_methods == ["*"]
    assert args.allowed_headers == ["*"] and args.allow_credentials is False
    args = serve_args("--allowed-origins", f'["{GOOD_ORIGIN}"]', "--allow-credentials")
    assert args.allowed_origins == [GOOD_ORIGIN] and args.allow_credentials is True
    for bad in ("http://good.example", '{"a": 1}', "[1, 2]"):
        with pytest.raises(SystemExit) as exit_info:
            serve_args("--allowed-origins", bad)
        assert exit_info.value.code == 2
        assert "--allowed-origins" in capsys.readouterr().err


def test_half_a_tls_pair_is_a_one_line_startup_error(tmp_path: Path) -> None:
    key, _ = make_self_signed(tmp_path)
    cmd = [sys.executable, "-m", "vllm_mamba.entrypoints.openai.api_server"]
    cmd += ["--model", tiny_model_dir("tied"), "--port", "0", "--ssl-keyfile", key]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--ssl-keyfile needs --ssl-certfile" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["closed", "not_listening", "udp"])
def test_fd_that_is_no_listening_tcp_socket_is_a_one_line_startup_error(kind: str) -> None:
    """`--fd` takes only a listening TCP socket; anything else fails before the model loads."""
    cmd = [sys.executable, "-m", "vllm_mamba.entrypoints.openai.api_server"]
    cmd += ["--model", tiny_model_dir("tied")]
    family, sock_type = socket.AF_INET, socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM
    with socket.socket(family, sock_type) as sock:
        sock.bind(("127.0.0.1", 0))
        fd = sock.fileno() if kind != "closed" else 1000
        pass_fds = (sock.fileno(),) if kind != "closed" else ()
        done = subprocess.run(
            [*cmd, "--fd", str(fd)], capture_output=True, text=True, timeout=120, pass_fds=pass_fds
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on --fd {fd}" in done.stderr and "Loaded" not in done.stderr
    assert "Traceback" not in done.stderr


# --- real servers ---


def test_https_server(tmp_path: Path) -> None:
    import openai

    key, cert = make_self_signed(tmp_path)
    verify = ssl.create_default_context(cafile=cert)
    flags = ("--ssl-keyfile", key, "--ssl-certfile", cert)
    with launch_server(*flags, https_ca=cert) as server:
        assert server.url.startswith("https://")
        with httpx.Client(verify=verify) as http_client:
            client = openai.OpenAI(
                base_url=f"{server.url}/v1", api_key=API_KEY, http_client=http_client
            )
            reply = client.completions.create(
                model=MODEL_NAME, prompt="def add(a, b):", max_tokens=4, temperature=0
            )
            assert reply.choices[0].text and reply.usage.completion_tokens == 4
        # plain http on the TLS port: no HTTP answer
        plain = server.url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{plain}/health", timeout=5)
        # an unverified certificate is refused by the client
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)


def test_cors(tmp_path: Path) -> None:
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": 2, "temperature": 0}
    with launch_server("--allowed-origins", f'["{GOOD_ORIGIN}"]') as server:
        url = f"{server.url}/v1/chat/completions"
        # a preflight needs no API key
        ok = httpx.options(url, headers={"Origin": GOOD_ORIGIN, **preflight})
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == GOOD_ORIGIN
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        refused = httpx.options(url, headers={"Origin": BAD_ORIGIN, **preflight})
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        # the actual cross-origin request
        reply = httpx.post(url, json=body, headers={"Origin": GOOD_ORIGIN, **server.headers})
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == GOOD_ORIGIN
        # still authenticated, and the 401 is readable by the allowed page
        denied = httpx.post(url, json=body, headers={"Origin": GOOD_ORIGIN})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == GOOD_ORIGIN
        other = httpx.post(url, json=body, headers={"Origin": BAD_ORIGIN, **server.headers})
        assert "access-control-allow-origin" not in other.headers
