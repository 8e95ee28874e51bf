"""Examples of extending hydra-ddp without editing it (see README, "Your own dataset")."""
