from baton.services.decode.server import main

main()
