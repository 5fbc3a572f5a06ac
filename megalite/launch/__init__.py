"""Start-up of a run: joining torch.distributed (rendezvous), the one-line failure board, and the
process-level wrapper that turns errors into exit codes."""
