"""Envelopes over MQTT: QoS 1, persistent sessions, reconnects, request/response, de-duplication.

One :class:`MqttTransport` per process role wraps a paho-mqtt 2.x client
(``CallbackAPIVersion.VERSION2``). Why it is shaped this way:

* **MQTT 5 when the broker has it, 3.1.1 otherwise.** ``protocol="auto"`` connects with
  MQTT 5 and falls back to 3.1.1 when the broker refuses it (amqtt). Reply-to and
  correlation id travel inside the envelope, so request/response works the same on
  3.1.1; on MQTT 5 they are mirrored into ResponseTopic/CorrelationData for other tools.
* **Nothing handed over is lost.** Sessions are persistent (3.1.1 ``clean_session=False``,
  5 ``clean_start=False`` + SessionExpiryInterval), paho's client queue is unbounded and it
  resends unacknowledged QoS 1 messages, in order, on every reconnect. While the link is
  down ``publish`` takes nothing and returns False, so the caller's own bounded outbox
  (flushed from a link listener) decides what to keep. QoS 1 means "at least once", so
  receivers drop redeliveries by envelope id (a bounded LRU).
* **Order per publisher.** One TCP connection, an in-flight window of 100 (the shipped
  Mosquitto's Receive Maximum), in-order resends and id de-duplication keep each
  publisher's stream in order at the subscriber.
* **Subscriptions survive every reconnect.** A subscription is active only once a SUBACK
  granted it on the current connection; every (re)connect subscribes everything again,
  whatever the session-present flag says (a SUBSCRIBE queued just before a link drop is
  lost while the broker resumes the session without it). A refused filter (SUBACK 0x80+) is
  logged as an error and retried with backoff. On MQTT 5 a re-subscription asks for retained
  messages only if the broker did not have it (Retain Handling 1); on 3.1.1 the re-sent
  retained messages are dropped as duplicates.
* **Shared subscriptions where the broker has them.** ``$share/{group}/…`` goes to the
  broker as is; on a broker that refused MQTT 5 (amqtt has no shared subscriptions) the
  plain filter is subscribed instead, so one consumer still gets every message.
* **Low latency.** TCP_NODELAY on the socket: paho leaves Nagle on, which costs a request
  written right after an acknowledgement ~40 ms (delayed ACK) per round trip.
* **Never crash on bad input.** Undecodable payloads are counted in ``stats`` and logged;
  handler exceptions are logged; API misuse raises :class:`TransportError`.

Handlers run on paho's network thread: keep them quick and hand real work to a queue.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from apiary.shared.config import MqttConfig
from apiary.shared.logs import get_logger
from apiary.shared.protocol import Body, Envelope, ProtocolError, decode, encode, make

log = get_logger(__name__)

Handler = Callable[[str, Envelope], None]
LinkListener = Callable[[bool], None]

DEFAULT_MAX_INFLIGHT = 100  # matches max_inflight_messages in deploy/mosquitto/mosquitto.conf
DEFAULT_SESSION_EXPIRY_S = 14 * 24 * 3600  # matches persistent_client_expiration 14d
DEFAULT_DEDUP_SIZE = 50_000
_FATAL_CONNACK = {"Not authorized", "Bad user name or password", "Client identifier not valid", "Banned",
                  "Bad authentication method"}
STAT_KEYS = ("published", "acked", "refused", "received", "duplicates", "decode_errors", "handler_errors",
             "reconnects", "subscribe_refused")


class TransportError(RuntimeError):
    """The MQTT link could not be set up, or the transport was used wrongly
    (not started, stopped, a subscription the broker refused, a call that would block
    the network thread)."""


class RecentIds:
    """Bounded LRU of envelope ids already handled: QoS 1 redeliveries are dropped, memory stays flat."""

    __slots__ = ("_ids", "size")

    def __init__(self, size: int = DEFAULT_DEDUP_SIZE) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self.size = size

    def seen(self, id_: str) -> bool:
        """True if ``id_`` was seen before; otherwise remember it and return False."""
        if id_ in self._ids:
            self._ids.move_to_end(id_)
            return True
        self._ids[id_] = None
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._ids)


@dataclass(slots=True)
class _Subscription:
    filter: str  # as the caller wrote it, possibly $share/{group}/…
    qos: int
    handlers: list[Handler] = field(default_factory=list)
    dedup: bool = True  # False: the handler is idempotent itself and wants re-sends (e.g. retried requests)
    granted: int | None = None  # QoS a SUBACK granted on the current connection; None: not active (yet)
    refusals: int = 0  # refusals since the last grant: the retry backoff

    @property
    def local_filter(self) -> str:
        """The filter matched locally: shared subscriptions deliver plain topics."""
        return self.filter.split("/", 2)[2] if self.filter.startswith("$share/") else self.filter


@dataclass(slots=True)
class _SubscribeSent:
    """One SUBSCRIBE waiting for its SUBACK: which filter, and whether a ``subscribe()`` caller waits on it
    (a refusal is then the caller's TransportError; otherwise it is retried)."""

    filter: str
    waited: bool
    refusal: str | None = None  # set by a refusing SUBACK of a waited SUBSCRIBE, for its caller


@dataclass(slots=True)
class _PendingRequest:
    request_id: str
    reply_topic: str
    done: threading.Event = field(default_factory=threading.Event)
    reply: Envelope | None = None


@dataclass(slots=True)
class _Attempt:
    """One connect attempt's outcome, filled in by the CONNACK/disconnect callbacks."""

    protocol: str
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    reason: str = ""
    kind: str = ""  # "refused" (auth: give up), "protocol" (try 3.1.1), "unreachable" (retry)
    settled: bool = False  # set once the first CONNACK succeeded; later callbacks are reconnects


def _no_delay(client: paho.Client, userdata: Any, sock: Any) -> None:
    """Disable Nagle: paho does not, and a small request written right after a PUBACK then
    waits for the broker's delayed ACK (~40 ms per round trip on Linux)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass  # not a TCP socket (e.g. a proxy or websocket wrapper): nothing to tune


class MqttTransport:
    """Publish and subscribe :class:`~shared.protocol.Envelope` s over one MQTT connection."""

    def __init__(self, config: MqttConfig, client_id: str, *, persistent: bool = True,
                 will: tuple[str, Envelope] | None = None, retain_will: bool = True,
                 max_inflight: int = DEFAULT_MAX_INFLIGHT, session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S,
                 dedup_size: int = DEFAULT_DEDUP_SIZE) -> None:
        if not client_id or len(client_id) > 128 or any(c in client_id for c in "+#/\0"):
            raise TransportError(f"invalid MQTT client id {client_id!r}")
        self.config = config
        self.client_id = client_id
        self.persistent = persistent
        self.max_inflight = max_inflight
        self.session_expiry_s = session_expiry_s
        self.protocol: str | None = None  # "5" or "3.1.1" once connected
        self.shared_subscriptions = True  # does the broker do $share/…? (decided at connect)
        self.stats: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self._will = will
        self._retain_will = retain_will
        self._lock = threading.RLock()
        self._subs: dict[str, _Subscription] = {}
        self._pending: dict[str, _PendingRequest] = {}
        self._listeners: list[LinkListener] = []
        self._recent = RecentIds(dedup_size)
        self._client: paho.Client | None = None
        self._connected = threading.Event()
        self._stopped = False
        self._net_thread: int | None = None
        self._suback = threading.Condition(self._lock)  # a subscription's state changed (SUBACK, link drop)
        self._subscribes: dict[int, _SubscribeSent] = {}  # mid -> SUBSCRIBE in flight on the current connection
        self._link_generation = 0  # bumped at every connect: a retry timer of an older link does nothing
        self._retries: set[threading.Timer] = set()
        self._refusals: dict[int, tuple[float, str]] = {}

    # ------------------------------------------------------------------ lifecycle

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def subscribed(self) -> bool:
        """Connected, and the broker granted every subscription on this connection (so messages flow)."""
        with self._lock:
            return self.connected and all(s.granted is not None for s in self._subs.values())

    def wait_subscribed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until :attr:`subscribed`; False if it did not happen in time."""
        with self._suback:
            return self._suback.wait_for(lambda: self.subscribed, timeout)

    def add_link_listener(self, fn: LinkListener) -> None:
        """``fn(True)`` after every (re)connect, ``fn(False)`` when the link drops; runs on the network thread."""
        with self._lock:
            self._listeners.append(fn)

    def start(self, timeout: float = 10.0) -> "MqttTransport":
        """Connect (retrying until ``timeout``), then keep reconnecting with backoff forever.

        Raises :class:`TransportError` when no connection is made within ``timeout`` or the
        broker refuses the credentials.
        """
        if self._stopped:
            raise TransportError("a stopped transport cannot be restarted; create a new one")
        if self._client is not None:
            return self
        deadline = time.monotonic() + timeout
        protocols = ("5", "3.1.1") if self.config.protocol == "auto" else (self.config.protocol,)
        last = "no attempt made"
        reported = False
        while True:
            for proto in protocols:
                attempt = self._attempt(proto, deadline)
                if attempt.ok:
                    return self
                last = f"MQTT {proto}: {attempt.reason}"
                if attempt.kind == "refused":
                    raise TransportError(f"{self.config.url} refused client {self.client_id!r}: {attempt.reason}")
                if attempt.kind != "protocol":
                    break  # broker not reachable yet: start over with the preferred protocol
            if not reported:  # at once, not after the whole timeout in silence: a broker may be starting alongside
                log.warning("cannot reach %s yet (%s); retrying every %g s for up to %g s", self.config.url, last,
                            self.config.reconnect_min_s, timeout)
                reported = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"could not connect to {self.config.url} within {timeout}s ({last})")
            time.sleep(min(self.config.reconnect_min_s, remaining))

    def stop(self, flush_timeout: float = 2.0) -> None:
        """Wait up to ``flush_timeout`` for unacknowledged publishes, then disconnect cleanly (no Last Will)."""
        if self._stopped:
            return
        client = self._client
        if client is not None and self.connected and threading.get_ident() != self._net_thread:
            deadline = time.monotonic() + flush_timeout
            while self.stats["published"] > self.stats["acked"] and time.monotonic() < deadline:
                time.sleep(0.01)
        self._stopped = True
        with self._lock:
            retries, self._retries = self._retries, set()
        for timer in retries:
            timer.cancel()
        if client is not None:
            client.disable_logger()  # paho 2.2 logs "Client is not connected" after sending its own clean DISCONNECT
            client.disconnect()
            client.loop_stop()
        self._connected.clear()

    def set_will(self, topic: str, env: Envelope, *, retain: bool = True) -> None:
        """Replace the Last Will; it takes effect at the next (re)connect (e.g. a new death certificate)."""
        self._will, self._retain_will = (topic, env), retain
        if self._client is not None:
            self._apply_will(self._client)

    def __enter__(self) -> "MqttTransport":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ publish / subscribe

    def publish(self, topic: str, env: Envelope, *, qos: int = 1, retain: bool = False,
                timeout: float | None = None) -> bool:
        """Hand ``env`` to the session for ``topic``; with ``timeout`` also wait for the PUBACK.

        ``timeout=None``: True once it is in the session (paho resends it after a reconnect
        until the broker acknowledges it), False when the link is down and nothing was
        taken: the caller keeps the message (an outbox) and republishes when a link listener
        says the link is back. ``timeout=x``: True if the broker acknowledged it within x s,
        False otherwise (not yet acknowledged, or refused on MQTT 5); never raises on link
        loss. Raises :class:`~shared.protocol.ProtocolError` for an envelope over
        ``max_payload``.
        """
        client = self._require_client()
        if not isinstance(env, Envelope):
            raise TransportError(f"publish takes an Envelope, got {type(env).__name__}")
        payload = encode(env, max_bytes=self.config.max_payload)
        if not self.connected:
            return False
        started = time.monotonic()
        try:
            info = client.publish(topic, payload, qos=qos, retain=retain, properties=self._properties(env))
        except ValueError as e:
            raise TransportError(f"cannot publish to {topic!r}: {e}") from None
        if info.rc == paho.MQTT_ERR_NO_CONN:
            info.rc = paho.MQTT_ERR_SUCCESS  # the link dropped just now: kept in the session, resent on reconnect
        elif info.rc != paho.MQTT_ERR_SUCCESS:
            log.warning("publish to %s failed: %s", topic, paho.error_string(info.rc))
            return False
        self._count("published")
        if timeout is None:
            return True
        self._forbid_on_network_thread("publish(timeout=...)")
        info.wait_for_publish(timeout)
        if not info.is_published():
            return False
        with self._lock:
            refusal = self._refusals.pop(info.mid, None)
        if refusal is not None and refusal[0] >= started:
            log.warning("broker refused publish to %s: %s", topic, refusal[1])
            return False
        return True

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1, *, timeout: float = 10.0,
                  dedup: bool = True) -> None:
        """Deliver decoded, de-duplicated envelopes matching ``topic_filter`` to ``handler``.

        Subscriptions are remembered and subscribed again at every reconnect. When connected
        this waits up to ``timeout`` for the broker to grant it (across a reconnect if the link
        drops meanwhile) and raises :class:`TransportError` if the broker refuses the filter
        (e.g. an ACL); a later refusal of a re-subscription is logged and retried.
        ``dedup=False`` hands repeated envelope ids to the handler too: for handlers that are
        idempotent on their own and must answer a deliberate re-send (a store-and-forward retry
        whose first reply was lost).
        """
        self._add_subscription(topic_filter, handler, qos, timeout, dedup)

    def request(self, topic: str, body_or_envelope: Body | Envelope, *, reply_topic: str,
                timeout: float) -> Envelope:
        """Publish a request with ``reply_to``/correlation id and wait for the matching reply.

        Raises :class:`TimeoutError` if no reply arrives within ``timeout``.
        """
        self._require_client()
        self._forbid_on_network_thread("request()")
        env = body_or_envelope if isinstance(body_or_envelope, Envelope) else make(body_or_envelope,
                                                                                   sender=self.client_id)
        corr = env.correlation_id or env.id
        env = env.model_copy(update={"reply_to": reply_topic, "correlation_id": corr})
        started = time.monotonic()
        with self._lock:
            needs_sub = reply_topic not in self._subs
        if needs_sub:
            self._add_subscription(reply_topic, None, 1, timeout)
        pending = _PendingRequest(request_id=env.id, reply_topic=reply_topic)
        with self._lock:
            if corr in self._pending:
                raise TransportError(f"a request with correlation id {corr!r} is already waiting")
            self._pending[corr] = pending
        try:
            while not self.publish(topic, env):  # link down: wait for it, within the same deadline
                left = timeout - (time.monotonic() - started)
                if left <= 0 or not self._connected.wait(left):
                    raise TimeoutError(f"link to {self.config.url} down; {env.type.value} {corr} not sent "
                                       f"within {timeout}s")
            left = max(0.0, timeout - (time.monotonic() - started))
            if not pending.done.wait(left) or pending.reply is None:
                raise TimeoutError(f"no reply on {reply_topic} to {env.type.value} {corr} within {timeout}s")
            return pending.reply
        finally:
            with self._lock:
                self._pending.pop(corr, None)

    def reply(self, request: Envelope, body: Body, *, timeout: float | None = None) -> bool:
        """Answer ``request`` on its ``reply_to`` topic, carrying its correlation id."""
        if not request.reply_to:
            raise TransportError(f"{request.type.value} {request.id} has no reply_to; nothing to reply to")
        env = make(body, sender=self.client_id, correlation_id=request.correlation_id or request.id)
        return self.publish(request.reply_to, env, timeout=timeout)

    # ------------------------------------------------------------------ internals: connecting

    def _attempt(self, proto: str, deadline: float) -> _Attempt:
        attempt = _Attempt(protocol=proto)
        client = self._make_client(proto, attempt)
        kwargs: dict[str, Any] = {}
        if proto == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s if self.persistent else 0
            kwargs = {"clean_start": not self.persistent, "properties": props}
        try:
            client.connect(self.config.host, self.config.port, keepalive=self.config.keepalive, **kwargs)
        except OSError as e:  # refused, unreachable, DNS, TLS handshake
            attempt.kind, attempt.reason = "unreachable", f"{type(e).__name__}: {e}"
            return attempt
        client.loop_start()
        wait = max(0.0, deadline - time.monotonic())
        if proto == "5" and self.config.protocol == "auto":
            wait /= 2  # leave time for 3.1.1 should a v3-only broker never answer a v5 CONNECT
        attempt.done.wait(wait)
        if attempt.ok:
            return attempt
        if not attempt.done.is_set():
            attempt.kind, attempt.reason = "unreachable", "no CONNACK before the deadline"
        client.disconnect()
        client.loop_stop()
        return attempt

    def _make_client(self, proto: str, attempt: _Attempt) -> paho.Client:
        cfg = self.config
        if proto == "5":
            client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=paho.MQTTv5,
                                 userdata=attempt)
        else:
            client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                 protocol=paho.MQTTv311, clean_session=not self.persistent, userdata=attempt)
        client.enable_logger(get_logger("paho.mqtt"))
        client.suppress_exceptions = True  # a bug in a callback is logged; it must not end paho's network thread
        client.max_inflight_messages_set(self.max_inflight)
        client.max_queued_messages_set(0)  # unbounded: never drop what the caller handed us
        client.reconnect_delay_set(cfg.reconnect_min_s, cfg.reconnect_max_s)
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password)
        if cfg.tls:
            try:
                client.tls_set(ca_certs=cfg.ca_file, certfile=cfg.cert_file, keyfile=cfg.key_file)
            except (OSError, ValueError) as e:
                raise TransportError(f"TLS setup failed (ca_file={cfg.ca_file!r}): {e}") from None
        if self._will is not None:
            self._apply_will(client)
        client.on_socket_open = _no_delay
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        return client

    def _apply_will(self, client: paho.Client) -> None:
        topic, env = self._will
        client.will_set(topic, encode(env, max_bytes=self.config.max_payload), qos=1, retain=self._retain_will)

    def _require_client(self) -> paho.Client:
        if self._stopped:
            raise TransportError("transport is stopped")
        if self._client is None:
            raise TransportError("transport not started: call start() first")
        return self._client

    def _forbid_on_network_thread(self, what: str) -> None:
        if threading.get_ident() == self._net_thread:
            raise TransportError(f"{what} inside a message handler would block the network thread; "
                                 "hand the work to another thread")

    def _properties(self, env: Envelope) -> Properties | None:
        if self.protocol != "5" or not (env.reply_to or env.correlation_id):
            return None
        props = Properties(PacketTypes.PUBLISH)
        if env.reply_to:
            props.ResponseTopic = env.reply_to
        if env.correlation_id:
            props.CorrelationData = env.correlation_id.encode()
        return props

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    # ------------------------------------------------------------------ internals: subscriptions

    def _add_subscription(self, topic_filter: str, handler: Handler | None, qos: int, timeout: float,
                          dedup: bool = True) -> None:
        if not isinstance(topic_filter, str) or not topic_filter:
            raise TransportError(f"invalid topic filter {topic_filter!r}")
        if topic_filter.startswith("$share/") and topic_filter.count("/") < 2:
            raise TransportError(f"shared subscription needs $share/<group>/<filter>, got {topic_filter!r}")
        with self._lock:
            sub = self._subs.get(topic_filter)
            is_new = sub is None
            if is_new:
                sub = self._subs[topic_filter] = _Subscription(topic_filter, qos, dedup=dedup)
            if handler is not None:
                sub.handlers.append(handler)
        if not is_new or not self.connected:
            return  # subscribed at the next (re)connect
        on_network_thread = threading.get_ident() == self._net_thread  # its SUBACK comes after this callback
        try:
            mid = self._send_subscribe(self._client, sub, waited=not on_network_thread, restore=False)
        except TransportError:
            with self._lock:
                self._subs.pop(topic_filter, None)
            raise
        if on_network_thread:
            return
        with self._suback:
            self._suback.wait_for(lambda: sub.granted is not None or self._refused(mid), timeout)
            sent = self._subscribes.get(mid) if mid is not None else None
            refusal = sent.refusal if sent is not None else None
            if refusal is not None:
                del self._subscribes[mid]
                self._subs.pop(topic_filter, None)
            elif sent is not None:
                sent.waited = False  # still unanswered: a late refusal is retried like a re-subscription's
            if refusal is None and sub.granted is None:
                log.warning("no SUBACK for %s within %ss; it is subscribed again at every reconnect", topic_filter,
                            timeout)
        if refusal is not None:
            raise TransportError(f"broker refused subscription to {topic_filter!r}: {refusal}")

    def _refused(self, mid: int | None) -> bool:
        sent = self._subscribes.get(mid) if mid is not None else None
        return sent is not None and sent.refusal is not None

    def _broker_filter(self, sub: _Subscription) -> str:
        if sub.filter.startswith("$share/") and not self.shared_subscriptions:
            return sub.local_filter  # one consumer gets everything rather than nobody getting anything
        return sub.filter

    def _send_subscribe(self, client: paho.Client, sub: _Subscription, *, waited: bool, restore: bool) -> int | None:
        """Send SUBSCRIBE for ``sub`` and remember its mid until the SUBACK; None if the link is down.

        ``restore``: a re-subscription (MQTT 5 then asks for retained messages only if the broker's
        session lacked the subscription: the first connect of a process wants them all again).
        """
        if self.protocol == "5":
            args: dict[str, Any] = {"options": SubscribeOptions(qos=sub.qos, retainHandling=int(restore))}
        else:
            args = {"qos": sub.qos}
        with self._lock:  # the SUBACK callback takes the lock too: the mid is registered before it can look
            try:
                rc, mid = client.subscribe(self._broker_filter(sub), **args)
            except ValueError as e:
                raise TransportError(f"invalid subscription {sub.filter!r}: {e}") from None
            if rc != paho.MQTT_ERR_SUCCESS or mid is None:
                return None  # not connected: the next connect subscribes it
            self._subscribes[mid] = _SubscribeSent(sub.filter, waited)
            return mid

    def _schedule_retry(self, sub: _Subscription) -> None:
        """Subscribe a refused filter again after a backoff (reconnect_min_s doubling up to reconnect_max_s)."""
        cfg = self.config
        delay = min(cfg.reconnect_max_s, cfg.reconnect_min_s * 2 ** min(sub.refusals - 1, 16))
        timer = threading.Timer(delay, self._retry, args=(sub.filter, self._link_generation))
        timer.daemon = True
        with self._lock:
            if self._stopped:
                return
            self._retries.add(timer)
        timer.start()

    def _retry(self, topic_filter: str, generation: int) -> None:
        with self._lock:
            self._retries = {t for t in self._retries if t.is_alive() and t is not threading.current_thread()}
            sub = self._subs.get(topic_filter)
            in_flight = any(s.filter == topic_filter for s in self._subscribes.values())
            if (self._stopped or not self.connected or generation != self._link_generation or sub is None
                    or sub.granted is not None or in_flight):
                return  # a reconnect subscribes it anyway, or it has been granted meanwhile
        self._send_subscribe(self._client, sub, waited=False, restore=True)

    # ------------------------------------------------------------------ paho callbacks (network thread)

    def _on_connect(self, client: paho.Client, attempt: _Attempt, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            name = reason.getName()
            if not attempt.settled:
                attempt.ok, attempt.reason = False, name
                attempt.kind = ("refused" if name in _FATAL_CONNACK
                                else "protocol" if name == "Unsupported protocol version" else "unreachable")
                attempt.done.set()
            else:
                log.warning("reconnect to %s refused: %s", self.config.url, name)
            return
        self._net_thread = threading.get_ident()
        first = not attempt.settled
        if first:
            self._client = client
            self.protocol = attempt.protocol
            # A broker that refuses MQTT 5 predates shared subscriptions (amqtt); MQTT 5 says so in CONNACK.
            fell_back = attempt.protocol == "3.1.1" and self.config.protocol == "auto"
            self.shared_subscriptions = not fell_back
        else:
            self._count("reconnects")
        if attempt.protocol == "5" and props is not None:
            self.shared_subscriptions = bool(getattr(props, "SharedSubscriptionAvailable", 1))
            receive_max = getattr(props, "ReceiveMaximum", None)
            if receive_max and receive_max < self.max_inflight:  # paho cannot adapt once connected
                log.warning("broker Receive Maximum %d < max_inflight %d: lower max_inflight", receive_max,
                            self.max_inflight)
        with self._lock:
            self._link_generation += 1
            self._connected.set()  # before the snapshot: a subscribe() racing with it is sent by one side or both
            subs = list(self._subs.values())
        for sub in subs:  # whatever session_present says: a SUBSCRIBE sent just before a drop may never have arrived
            self._send_subscribe(client, sub, waited=False, restore=not first)
        if first and not self.shared_subscriptions and any(s.filter.startswith("$share/") for s in subs):
            log.warning("broker %s has no shared subscriptions: each consumer receives every message",
                        self.config.url)
        log.info("connected to %s as %s (MQTT %s, session present: %s)", self.config.url, self.client_id,
                 attempt.protocol, flags.session_present)
        if first:
            attempt.ok = attempt.settled = True
            attempt.done.set()
        self._notify(True)

    def _on_disconnect(self, client: paho.Client, attempt: _Attempt, flags: Any, reason: Any, props: Any) -> None:
        if not attempt.settled:
            if not attempt.done.is_set():
                attempt.reason = f"connection closed before CONNACK ({reason})"
                # An MQTT 3.1.1-only broker may just hang up on an MQTT 5 CONNECT.
                attempt.kind = "protocol" if attempt.protocol == "5" else "unreachable"
                attempt.done.set()
            return
        with self._suback:
            was_up = self._connected.is_set()
            self._connected.clear()
            for sub in self._subs.values():
                sub.granted = None  # until a SUBACK on the next connection
            self._subscribes.clear()  # never answered now; a waiting subscribe() waits for the re-subscription
            self._suback.notify_all()
        if was_up:
            if not self._stopped:
                log.warning("lost connection to %s (%s); reconnecting", self.config.url, reason)
            self._notify(False)

    def _on_publish(self, client: paho.Client, attempt: _Attempt, mid: int, reason: Any, props: Any) -> None:
        self._count("acked")
        if reason is not None and reason.is_failure:
            self._count("refused")
            now = time.monotonic()
            with self._lock:
                self._refusals[mid] = (now, reason.getName())
                if len(self._refusals) > 1024:  # only unclaimed refusals of fire-and-forget publishes pile up
                    for old in [m for m, (t, _) in self._refusals.items() if now - t > 60]:
                        del self._refusals[old]

    def _on_subscribe(self, client: paho.Client, attempt: _Attempt, mid: int, codes: list[Any], props: Any) -> None:
        retry = None
        with self._suback:
            sent = self._subscribes.get(mid)
            sub = self._subs.get(sent.filter) if sent is not None else None
            if sent is None or sub is None:
                return  # a SUBACK of a previous link, or of a subscription refused to its caller already
            bad = [str(c) for c in codes if getattr(c, "is_failure", False)]
            if not bad:
                del self._subscribes[mid]
                sub.granted = min((c.value for c in codes), default=sub.qos)
                sub.refusals = 0
            else:
                self.stats["subscribe_refused"] += 1
                sub.granted = None
                sub.refusals += 1
                if sent.waited:
                    sent.refusal = ", ".join(bad)  # its subscribe() caller raises
                else:
                    del self._subscribes[mid]
                    retry = sub
            self._suback.notify_all()
        if retry is not None:
            log.error("broker refused subscription to %s: %s; retrying", retry.filter, ", ".join(bad))
            self._schedule_retry(retry)

    def _on_message(self, client: paho.Client, attempt: _Attempt, msg: paho.MQTTMessage) -> None:
        self._count("received")
        try:
            env = decode(msg.payload, max_bytes=self.config.max_payload)
        except ProtocolError as e:
            self._count("decode_errors")
            log.warning("dropped undecodable payload on %s: %s", msg.topic, e)
            return
        duplicate = self._recent.seen(env.id)
        if duplicate:
            self._count("duplicates")
        with self._lock:
            pending = self._pending.get(env.correlation_id) if env.correlation_id and not duplicate else None
            handlers: list[Handler] = []
            for sub in self._subs.values():  # overlapping filters: each handler still sees a message once
                if (not duplicate or not sub.dedup) and paho.topic_matches_sub(sub.local_filter, msg.topic):
                    handlers.extend(h for h in sub.handlers if h not in handlers)
        if pending is not None and msg.topic == pending.reply_topic and env.id != pending.request_id:
            pending.reply = env
            pending.done.set()
        for handler in handlers:
            try:
                handler(msg.topic, env)
            except Exception:
                self._count("handler_errors")
                log.exception("handler %s failed on %s %s from %s", getattr(handler, "__qualname__", handler),
                              env.type.value, env.id, msg.topic)

    def _notify(self, up: bool) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(up)
            except Exception:
                log.exception("link listener %r failed", fn)
