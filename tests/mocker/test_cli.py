"""The ``mock-engine`` subcommand and ``python -m mocker``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rankgate.mocker.cli import config_from_args, register
from tests.support.polling import wait_until
from tests.support.ports import free_port


def test_register_maps_flags_onto_the_config() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "mock-engine",
            "--port", "6000",
            "--dp-size", "4",
            "--model", "m",
            "--block-size", "32",
            "--kv-events-port", "7000",
            "--kv-replay-port", "7100",
            "--speed", "0",
            "--rank-speeds", "0.4,1",
            "--seed", "3",
            "--paced-step-seconds", "0.002",
            "--grpc-server", "grpcio",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.port, config.dp_size, config.model, config.block_size) == (6000, 4, "m", 32)
    assert (config.kv_events_port, config.kv_replay_port) == (7000, 7100)
    assert (config.speed, config.seed, config.paced_step_seconds) == (0.0, 3, 0.002)
    assert config.rank_speeds == (0.4, 1.0)
    assert config.grpc_server == "grpcio"
    assert args.handler is not None
    assert config_from_args(parser.parse_args(["mock-engine"])).grpc_server == "inloop"


def test_python_dash_m_serves_until_stopped() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rankgate.mocker", "--port", str(port), "--speed", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=20)
            stub = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            wait_until(serving, 5, "the mock engine serving")
    finally:
        process.terminate()
        process.wait(10)
