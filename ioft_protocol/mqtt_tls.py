"""The TLS and plaintext checks a session makes before it connects, and the TLS context it uses.

Run without a client, so that ``--check`` style commands (:mod:`ioft_protocol.cli`) and the session
refuse the same things with the same line.
"""

from __future__ import annotations

import ssl

from ioft_protocol.mqtt_options import MqttError, SessionOptions


def check_options(options: SessionOptions) -> ssl.SSLContext | None:
    """What a session refuses before it connects, checked without a client; the TLS context, if any.

    Raises
    ------
    MqttError
        A plaintext URL without ``allow_plaintext``, a TLS URL without a CA, TLS files with a
        plaintext URL, or TLS files that do not load.
    """
    if options.tls is None and not options.broker.tls and not options.allow_plaintext:
        raise MqttError(
            f"refusing plaintext broker {options.broker.url()}: use mqtts:// with a CA, "
            "or set allow_plaintext (tests and loopback demos only)"
        )
    if options.broker.tls and options.tls is None:
        raise MqttError(f"{options.broker.url()} needs TLS options (at least the fleet CA file)")
    if options.tls is not None and not options.broker.tls:
        # paho would quietly speak TLS to an mqtt:// URL; say what is meant instead.
        raise MqttError(
            f"TLS is configured but the broker URL {options.broker.url()} is plaintext: "
            f"use mqtts://{options.broker.host}:<tls port>"
        )
    if options.tls is None:
        return None
    tls = options.tls
    files = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}
    for name, path in files.items():
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise MqttError(
                    f"cannot read TLS {name} {path}: {exc.strerror or exc}; "
                    f"fix [tls] {name} in the config, or put the file there"
                ) from None
    # Verify the broker against the fleet CA and its host name; present our certificate.
    try:
        ctx = ssl.create_default_context(cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise MqttError(f"TLS ca_file {tls.ca_file} holds no CA certificate (PEM): {exc}") from None
    if tls.cert_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise MqttError(
                f"TLS cert_file {tls.cert_file} and key_file {tls.key_file} are not a certificate and "
                f"its key (PEM, one pair): {exc}"
            ) from None
    return ctx
