"""SMG's smg.worker.v1 wire contract (worker_inference.proto, worker_control.proto), imported as
``specmesh.smg``; the router serves it (`specmesh.router.smg_worker`, docs/smg.md). The *_pb2*
files are generated: ``python protos/generate_smg.py``."""
