"""The transfer link handshake over the in-process transport: both sides prove they hold the cluster secret
(challenge-response with nonces from both sides), and nothing is registered before they have.

Rogue peers are TransferService subclasses that skip or fake a step, as an attacker's code would.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kunserve.shared.transfer import ACTIVATION, CONTROL, MemoryTransport, TransferConfig, TransferError, TransferService
from kunserve.shared.transfer.framing import FRAME_MAX
from kunserve.shared.transfer.service import AUTH, HELLO, NONCE_BYTES, WELCOME, handshake_mac

pytestmark = pytest.mark.timeout(60)

SECRET = b"the-cluster-secret-0123456789abcdef"
CONFIG = TransferConfig(connect_timeout_s=2.0)


def svc(name, registry, secret=SECRET, **kw):
    return TransferService(name, MemoryTransport(registry), CONFIG, secret=secret, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def settle() -> None:
    for _ in range(20):  # let the listener's accept task finish its side
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)


class NoProof(TransferService):
    """Claims a name and sends an AUTH with a made-up MAC, never checking the listener's."""

    async def _handshake_as_connector(self, ep, expect):
        buf = np.empty(FRAME_MAX, np.uint8)
        await self._send_control(ep, HELLO, nonce=b"n" * NONCE_BYTES)
        h = await self._expect(ep, buf, HELLO)
        await self._send_control(ep, AUTH, mac=self.fake_mac(h))
        await self._expect(ep, buf, WELCOME)
        return h.source

    def fake_mac(self, listener_hello) -> bytes:
        return b"\0" * 32


class Replayer(NoProof):
    """Replays the connector MAC of an earlier, legitimate handshake (with the same nonce it used)."""

    recorded: tuple[bytes, bytes] = (b"", b"")  # (connector nonce, connector mac)

    async def _handshake_as_connector(self, ep, expect):
        buf = np.empty(FRAME_MAX, np.uint8)
        await self._send_control(ep, HELLO, nonce=self.recorded[0])
        h = await self._expect(ep, buf, HELLO)
        await self._send_control(ep, AUTH, mac=self.recorded[1])
        await self._expect(ep, buf, WELCOME)
        return h.source


def test_holders_of_the_secret_link_and_exchange_messages():
    async def main():
        reg = {}
        a, b = svc("a", reg), svc("b", reg, members={"a", "b"})
        await a.start()
        port = await b.start()
        assert await a.connect("mem", port, expect="b") == "b"
        await b.wait_for_peer("a", timeout=5)
        await a.send("b", ACTIVATION, torch.arange(4), name="x", timeout=5)
        assert torch.equal((await b.recv(ACTIVATION, timeout=5)).data, torch.arange(4))
        await a.close()
        await b.close()

    run(main())


@pytest.mark.parametrize("rogue", ["wrong_secret", "no_proof", "replay"])
def test_a_peer_without_the_secret_is_refused_and_never_registered(rogue):
    async def main():
        reg = {}
        b = svc("b", reg)
        port = await b.start()
        if rogue == "replay":  # a legitimate handshake first, recorded on the wire
            good = svc("a", reg)
            sent = []
            orig = good._send_control

            async def spy(ep, verb, nonce=b"", mac=b""):
                sent.append((verb, nonce, mac))
                await orig(ep, verb, nonce, mac)

            good._send_control = spy
            await good.connect("mem", port)
            await good.close()
            await settle()
            Replayer.recorded = (next(n for v, n, _ in sent if v == HELLO), next(m for v, _, m in sent if v == AUTH))
            bad = Replayer("a", MemoryTransport(reg), CONFIG, secret=b"x" * 32)
        elif rogue == "no_proof":
            bad = NoProof("a", MemoryTransport(reg), CONFIG, secret=b"x" * 32)
        else:
            bad = svc("a", reg, secret=b"not-the-cluster-secret-0123456789")
        with pytest.raises(TransferError, match="handshake"):
            await bad.connect("mem", port)
        await settle()
        assert b.peers == [] and bad.peers == []
        await bad.close()
        await b.close()

    run(main())


def test_names_are_checked_before_registering():
    async def main():
        reg = {}
        b = svc("b", reg, members={"a", "b"})
        port = await b.start()
        outsider, me = svc("z", reg), svc("b", reg)
        for who in (outsider, me):  # not a member; b's own name
            with pytest.raises(TransferError):
                await who.connect("mem", port)
        a = svc("a", reg)
        with pytest.raises(TransferError, match="not 'c'"):  # a listener that is not who we meant to reach
            await a.connect("mem", port, expect="c")
        await settle()
        assert b.peers == [] and a.peers == [] and outsider.peers == []
        for s in (a, b, outsider, me):
            await s.close()

    run(main())


def test_a_second_link_under_a_live_name_never_replaces_the_first():
    async def main():
        reg = {}
        a, b = svc("a", reg), svc("b", reg)
        await a.start()
        port = await b.start()
        await a.connect("mem", port)
        await b.wait_for_peer("a", timeout=5)
        first = b._peers["a"]
        impostor = svc("a", reg)  # holds the secret (a member can claim any name: see the README)
        await impostor.connect("mem", port)
        await settle()
        assert b._peers["a"] is first and first.endpoint is not None and len(first.endpoints) == 2
        await impostor.send("b", CONTROL, b"", name="x", timeout=5)
        await b.recv(CONTROL, timeout=5)
        await impostor.close()  # its bye and its closed link end only that link
        await settle()
        assert b.peers == ["a"] and b._peers["a"] is first and len(first.endpoints) == 1
        await a.send("b", ACTIVATION, torch.ones(3), timeout=5)
        assert torch.equal((await b.recv(ACTIVATION, timeout=5)).data, torch.ones(3))
        await a.close()
        await b.close()

    run(main())


def test_the_mac_binds_role_names_and_nonces():
    base = handshake_mac(SECRET, "listener", "a", "b", b"1" * 32, b"2" * 32)
    for changed in (handshake_mac(SECRET, "connector", "a", "b", b"1" * 32, b"2" * 32),
                    handshake_mac(SECRET, "listener", "b", "a", b"1" * 32, b"2" * 32),
                    handshake_mac(SECRET, "listener", "a", "b", b"3" * 32, b"2" * 32),
                    handshake_mac(SECRET, "listener", "a", "b", b"1" * 32, b"3" * 32),
                    handshake_mac(b"other" * 8, "listener", "a", "b", b"1" * 32, b"2" * 32),
                    handshake_mac(SECRET, "listener", "ab", "", b"1" * 32, b"2" * 32)):
        assert changed != base


def test_a_service_needs_a_secret():
    with pytest.raises(ValueError, match="secret"):
        TransferService("a", MemoryTransport({}), secret=b"")
