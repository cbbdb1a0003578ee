"""A P/D consumer's word to a producer after a read (engine/kv_transfer.py says how the hand-over runs): POST
{remote_url}/kv_transfer/release ends the offer's lease, and the producer answers {"held": true} only when the lease
was still held then. P lets a lease's blocks go only when the lease ends, so a lease still held after the read
ended held them for the whole read; otherwise P may have given them to another sequence during it, and D must not
publish what it read.

Each request runs in a thread of its own, and its answer comes back through a callback (the consumer's connector
queues it for the loop's next turn: kv_connector/pd.py), so the loop never waits on another server. P answers from
its HTTP thread (ProducerConnector.release: the connector keeps each open lease's end), so a long step of P's never
makes a lease that held look ended.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from typing import Callable

from dsconv.runner.engine.kv_transfer import Offer

# a producer's route where a consumer ends a lease (outside /v1/: a consumer holds no API key; ending a lease early
# only makes the consumer's own read count as failed)
RELEASE_PATH = "/kv_transfer/release"
# how long a consumer waits for the answer (P's HTTP thread answers from its connector's record of the leases, without
# waiting for its loop); one that takes longer is taken as not held (the read fails, kv_load_failure_policy decides)
RELEASE_TIMEOUT_S = 5.0


def end_lease(offer: Offer, on_answer: Callable[[bool, str], None] | None = None) -> None:
    """Ends an offer's lease at its producer, from a thread; on_answer(held, why not) once P has answered (or could
    not be asked). Without on_answer (the read failed, or there was nothing to read) the answer is not needed: a
    producer that cannot be told lets the blocks go when the lease ends."""
    def post() -> None:
        body = json.dumps({"transfer_id": offer.transfer_id}).encode()
        request = urllib.request.Request(f"{offer.release_url.rstrip('/')}{RELEASE_PATH}", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=RELEASE_TIMEOUT_S) as reply:
                answer = json.loads(reply.read())
            held = isinstance(answer, dict) and answer.get("held") is True
            why = "" if held else f"the producer's lease on transfer {offer.transfer_id} ended before the read did"
        except Exception as exc:  # noqa: BLE001  (any failure to ask is "not held": the request must hear an answer)
            held, why = False, f"the producer at {offer.release_url} did not answer for transfer {offer.transfer_id} " \
                               f"({exc})"
            if on_answer is None:
                print(f"dsrun: {why}; its lease frees the blocks", file=sys.stderr, flush=True)
        if on_answer is not None:
            on_answer(held, why)

    threading.Thread(target=post, name="kv-transfer-release", daemon=True).start()
