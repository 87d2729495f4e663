"""data stage of mindspeed-pack."""
