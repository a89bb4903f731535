/* A tiny OpenAI-shaped HTTP server for the container workload test, built static so an
 * image FROM scratch holds nothing else: listens on 0.0.0.0:$PORT; GET /health answers
 * {"status": "ok"}, GET /v1/models lists $MODEL, anything else a chat completion;
 * with --probe it only prints ok. */
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void answer(int fd, const char *body) {
    char head[256];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     strlen(body));
    write(fd, head, (size_t)n);
    write(fd, body, strlen(body));
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--probe") == 0) { /* can containers run here? */
        puts("ok");
        return 0;
    }
    const char *port = getenv("PORT");
    const char *model = getenv("MODEL");
    char models[512];
    snprintf(models, sizeof models,
             "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\"}]}",
             model ? model : "tiny");
    signal(SIGPIPE, SIG_IGN);
    int server = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in address = {0};
    address.sin_family = AF_INET;
    address.sin_port = htons((unsigned short)atoi(port ? port : "8080"));
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(server, (struct sockaddr *)&address, sizeof address) || listen(server, 16)) {
        perror("listen");
        return 1;
    }
    printf("listening on %s\n", port ? port : "8080");
    fflush(stdout);
    for (;;) {
        int client = accept(server, NULL, NULL);
        if (client < 0) continue;
        char request[4096] = {0};
        read(client, request, sizeof request - 1);
        if (strncmp(request, "GET /health", 11) == 0)
            answer(client, "{\"status\":\"ok\"}");
        else if (strncmp(request, "GET /v1/models", 14) == 0)
            answer(client, models);
        else
            answer(client, "{\"object\":\"chat.completion\",\"choices\":[{\"index\":0,"
                           "\"message\":{\"role\":\"assistant\",\"content\":\"hi\"}}]}");
        close(client);
    }
}
