"""The one home of the Kafka and S3 clients every service builds: the leaf of ``infra`` that services may import.

- `connection`: the Kafka, S3 and data-key fields every service's settings inherit (pydantic mixins, each
  service keeping its own environment prefix); secrets read from the files they name, never an example value;
  key files read only when their owner alone may change them (`read_private_file`).
- `kafka`: the connection fields (`infra.clients.connection.KafkaConnectionFields`) translated once into aiokafka
  options (`aiokafka_kwargs`: security protocol, SASL, and an `ssl.SSLContext` for every client that asks for
  SSL) and into FastStream's security object (`faststream_security`).
- `s3`: one boto3 client factory (`make_s3_client`) with one named timeout/retry policy per use (`S3Policy`),
  path-style addressing and TLS verification, and one reading of botocore's errors (`is_missing`,
  `is_already_written`).
- `digest`: a file's and a directory's sha256 (the model manifest's digests, a LoRA adapter's identity), so the
  sidecar and the lanes hash an adapter the same way.
- `shutdown`: the stop event SIGINT and SIGTERM set, which the archiver and the replayer service run until
  (`stop_on_signals`).

Imports: only `schemas` of ours (plus ssl, signal, aiokafka / faststream / boto3 / botocore, the heavy ones inside
functions). The sidecar (`capture`), its ledger and audit jobs, the replayer and the rest of ``infra`` import
this package; it imports none of them, so importing it never pulls a service in.
"""
