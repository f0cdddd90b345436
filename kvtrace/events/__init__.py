"""KV events: what a replay's radix cache stores and evicts, in SGLang's event format.

``blocks`` holds the event types and SGLang's block hashing; ``emit`` derives the events
a replay's cache publishes (``kvtrace replay --kv-events``); ``wire`` is the wire format
(topic, sequence, msgpack payload) to a file or a ZMQ PUB socket; ``check`` reads a
recorded or live stream (vLLM's and SGLang's schema) and checks it, alone or against a
replay (``kvtrace events check``); ``record`` records a live stream to a file, filling
gaps through the publisher's replay endpoint (``kvtrace events record``). Importing
this package imports none of them.
"""
