"""Models at work: an answer from the machine's own model for every new layer or weld.

Rows flow from ``edge-recorder`` to ``edge-trainer`` through the **row feed**
(``<state_dir>/serving/rows.jsonl``, :mod:`edge.feed`): the recorder appends a
row the moment its features exist (a completed layer; a weld picked up from the watched
folder, labelled or not) and nudges the trainer through a datagram socket.  The trainer's
:class:`~edge.serving.server.Server` answers it with the task's **serving model**
(:mod:`edge.serving.model`: after each round it takes part in, the best of its candidates --
its personal model, the fleet's global, its model trained alone -- on its newest rows,
:mod:`edge.serving.candidates`, when a quality gate lets it), then
appends the answer to a bounded local log and publishes it on
``ioft/v1/<fleet>/answer/<device>/<task>`` (QoS 1, retained).

One answer record (:class:`~edge.serving.records.Answer`) carries the device, the task,
the row's key (``<job>#<run>/<layer>`` or the weld id), when the row's features existed,
the serving model's identity (task, round, encoder version), the candidate that gave it and
the latency from row to answer.  A row the serving model cannot take (schema, width, an answer that is not
finite) gets no answer: the refusal is counted in the trainer's status.
"""
