"""model stage of mindspeed-pack."""
