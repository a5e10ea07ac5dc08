"""How ranks talk: torch.distributed collectives, the injected transport, device staging, and the
pure arithmetic of averaging."""
