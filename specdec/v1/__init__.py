"""Generated gRPC code (scripts/gen_protos.sh). Do not edit."""
