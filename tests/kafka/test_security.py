"""SASL and TLS on real brokers: right credentials work, wrong or missing ones are refused,
a client that does not trust the broker's CA is refused, and the password never shows
up in reprs or logs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError

from pipeline.core.config import ConfigError, KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics
from tests.support.kafka import SASL_USERS, consume_n, json_values, produce_json

PASSWORD = SASL_USERS["batchtide"]


async def _round_trip(
    settings: KafkaSettings, topic: str, partitions: int, values: list[dict[str, int]]
) -> list[object]:
    """`values` produced to a new topic and read back, with `settings`' security."""
    await create_topics(settings, {topic: partitions})
    await produce_json(settings, topic, values)
    return json_values(await consume_n(settings, topic, len(values)))


@pytest.mark.kafka
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_right_credentials_produce_and_consume(
    sasl_kafka_settings: KafkaSettings, mechanism: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = dataclasses.replace(sasl_kafka_settings, sasl_mechanism=mechanism)  # type: ignore[arg-type]
    values = [{"n": n} for n in range(20)]
    with caplog.at_level(logging.DEBUG):
        received = asyncio.run(_round_trip(settings, f"{settings.topic_prefix}.secure", 2, values))
    assert sorted(received, key=lambda v: v["n"]) == values  # type: ignore[index]
    assert PASSWORD not in caplog.text


async def _bootstrap(settings: KafkaSettings) -> None:
    producer = AIOKafkaProducer(**client_options(settings), request_timeout_ms=5000)
    try:
        await producer.start()
    finally:
        await producer.stop()


@pytest.mark.kafka
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_wrong_password_is_refused(
    sasl_kafka_settings: KafkaSettings,
    mechanism: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("BATCHTIDE_KAFKA_PASSWORD", "not-the-password")
    settings = dataclasses.replace(sasl_kafka_settings, sasl_mechanism=mechanism)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        asyncio.run(_bootstrap(settings))
    assert "SaslAuthenticationFailed" in caplog.text


@pytest.mark.kafka
def test_unknown_user_is_refused(sasl_kafka_settings: KafkaSettings, caplog: pytest.LogCaptureFixture) -> None:
    settings = dataclasses.replace(sasl_kafka_settings, sasl_username="mallory")
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        asyncio.run(_bootstrap(settings))
    assert "SaslAuthenticationFailed" in caplog.text


@pytest.mark.kafka
def test_client_without_sasl_is_refused(sasl_kafka_settings: KafkaSettings) -> None:
    settings = KafkaSettings(bootstrap_servers=sasl_kafka_settings.bootstrap_servers)
    with pytest.raises(KafkaConnectionError):
        asyncio.run(_bootstrap(settings))


def test_sasl_without_a_password_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHTIDE_KAFKA_PASSWORD", raising=False)
    settings = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_username="batchtide")
    with pytest.raises(ConfigError, match="BATCHTIDE_KAFKA_PASSWORD"):
        client_options(settings)


def test_client_options_never_show_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "pa55-\"word'-zz"
    monkeypatch.setenv("BATCHTIDE_KAFKA_PASSWORD", secret)
    settings = KafkaSettings(
        bootstrap_servers="broker:9093",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="batchtide",
    )
    options = client_options(settings)
    assert options["sasl_plain_password"] == secret, "aiokafka must still receive the real password"
    assert options["sasl_mechanism"] == "SCRAM-SHA-256"
    assert options["sasl_plain_username"] == "batchtide"
    for shown in (repr(options), str(options), f"{options}", f"{options!r}", repr([options])):
        assert secret not in shown
        assert "***" in shown
    assert secret not in repr(settings), "the settings object holds no password at all"


def test_tls_settings_build_an_ssl_context() -> None:
    settings = KafkaSettings(security_protocol="SSL")
    options = client_options(settings)
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError, match="security_protocol"):
        client_options(KafkaSettings(ssl_cafile="/etc/ssl/certs/ca-certificates.crt"))


@pytest.mark.kafka
def test_sasl_over_tls_round_trip(tls_kafka_settings: KafkaSettings) -> None:
    values = [{"n": n} for n in range(10)]
    assert asyncio.run(_round_trip(tls_kafka_settings, f"{tls_kafka_settings.topic_prefix}.tls", 1, values)) == values


@pytest.mark.kafka
def test_tls_client_that_does_not_trust_the_ca_is_refused(
    tls_kafka_settings: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    untrusting = dataclasses.replace(tls_kafka_settings, ssl_cafile=None)
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        asyncio.run(_bootstrap(untrusting))
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text


@pytest.mark.kafka
def test_plaintext_sasl_client_is_refused_by_the_tls_listener(tls_kafka_settings: KafkaSettings) -> None:
    cleartext = dataclasses.replace(tls_kafka_settings, security_protocol="SASL_PLAINTEXT", ssl_cafile=None)
    with pytest.raises(KafkaConnectionError):
        asyncio.run(_bootstrap(cleartext))
