"""training stage of mindspeed-pack."""
